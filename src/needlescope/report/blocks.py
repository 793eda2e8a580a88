"""A report as a list of blocks, rendered to Markdown and to one self-contained HTML page.

Blocks (tuples, so a report is plain data):

- ``("h", level, text)``, ``("p", text)``, ``("table", header, rows)``,
  ``("img", file, caption)``;
- ``("box", title, [(label, text), ...])``: the summary a reader must see first, a framed box
  in HTML (class ``summary``) and a quoted block in Markdown;
- ``("details", summary, [blocks])``: folded in HTML (``<details>``), an HTML ``<details>`` in
  Markdown too (GitHub and GitLab render it; other viewers show the blocks inside);
- ``("footer", text)``: small print at the end (class ``footer``).

Text may use ``**bold**`` and ```code``` spans; everything else is escaped in HTML. The HTML embeds
images as data URIs, so the page needs no other file.
"""

from __future__ import annotations

import base64
import html

__all__ = ["render_md", "render_html", "SUMMARY_CLASS", "STYLE"]

SUMMARY_CLASS = "summary"
# The summary box's colours are its identity in a screenshot (tests find it by them).
SUMMARY_BACKGROUND = "#fff6d8"
SUMMARY_BORDER = "#c98a00"
STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:1.2em auto;color:#111;background:#fff}"
    "h1{margin:0.2em 0 0.4em}"
    "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #999;padding:3px 6px;vertical-align:top}"
    "th{background:#e8eef7}code{background:#f3f3f3}img{max-width:100%}"
    f".{SUMMARY_CLASS}{{background:{SUMMARY_BACKGROUND};border:3px solid {SUMMARY_BORDER};border-radius:6px;"
    "padding:0.6em 1.2em;margin:0.6em 0 1.2em;font-size:15px}"
    f".{SUMMARY_CLASS} h2{{margin:0.2em 0 0.4em;font-size:20px}}"
    f".{SUMMARY_CLASS} dl{{display:grid;grid-template-columns:11em 1fr;gap:0.35em 1em;margin:0}}"
    f".{SUMMARY_CLASS} dt{{font-weight:bold}}.{SUMMARY_CLASS} dd{{margin:0}}"
    f".{SUMMARY_CLASS} code{{background:#fdeeb8}}"
    "details{margin:1em 0}summary{cursor:pointer;font-weight:bold}"
    ".footer{margin-top:2.5em;padding-top:0.6em;border-top:1px solid #bbb;color:#555;font-size:12px}"
)


def _md_table(header, rows) -> list[str]:
    out = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def render_md(blocks: list[tuple]) -> str:
    """The blocks as Markdown."""
    out: list[str] = []
    for blk in blocks:
        kind = blk[0]
        if kind == "h":
            out += ["#" * blk[1] + " " + blk[2], ""]
        elif kind == "p":
            out += [blk[1], ""]
        elif kind == "table":
            out += [*_md_table(blk[1], blk[2]), ""]
        elif kind == "img":
            out += [f"![{blk[2]}]({blk[1]})", ""]
        elif kind == "box":
            out += [f"> **{blk[1]}**", ">"] + [f"> - **{label}:** {text}" for label, text in blk[2]] + [""]
        elif kind == "details":
            out += [
                "<details>",
                f"<summary>{html.escape(blk[1])}</summary>",
                "",
                render_md(blk[2]),
                "</details>",
                "",
            ]
        elif kind == "footer":
            out += ["---", "", blk[1], ""]
    return "\n".join(out)


def _inline(text: str) -> str:
    parts = html.escape(text).split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("**")
    return "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))


def _html_blocks(blocks: list[tuple], images: dict[str, bytes]) -> list[str]:
    body: list[str] = []
    for blk in blocks:
        kind = blk[0]
        if kind == "h":
            body.append(f"<h{blk[1]}>{_inline(blk[2])}</h{blk[1]}>")
        elif kind == "p":
            body.append(f"<p>{_inline(blk[1])}</p>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(str(c))}</th>" for c in blk[1])
            rows = "".join(
                "<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in r) + "</tr>" for r in blk[2]
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(images[blk[1]]).decode()
            alt = html.escape(blk[2])
            body.append(
                f'<figure><img alt="{alt}" src="data:image/png;base64,{data}"><figcaption>{alt}</figcaption></figure>'
            )
        elif kind == "box":
            items = "".join(f"<dt>{_inline(label)}</dt><dd>{_inline(text)}</dd>" for label, text in blk[2])
            body.append(
                f'<section class="{SUMMARY_CLASS}"><h2>{_inline(blk[1])}</h2><dl>{items}</dl></section>'
            )
        elif kind == "details":
            inner = "".join(_html_blocks(blk[2], images))
            body.append(f"<details><summary>{_inline(blk[1])}</summary>{inner}</details>")
        elif kind == "footer":
            body.append(f'<footer class="footer">{_inline(blk[1])}</footer>')
    return body


def render_html(blocks: list[tuple], images: dict[str, bytes], title: str = "DIAGNOSIS") -> str:
    """The blocks as one HTML page; ``images`` maps each ``img`` block's file name to its PNG bytes."""
    body = "".join(_html_blocks(blocks, images))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )
