"""DIAGNOSIS.md and DIAGNOSIS.html of an investigation run, from ``investigation.json`` only.

Both are rendered from one list of blocks (heading, paragraph, table, image), so they say the
same thing; the HTML embeds the plots as data URIs and needs no other file. Every conclusion
is printed next to the measurement it rests on.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from needlescope.investigate.signature import HOLD, rank_percentile, tracks_topk

__all__ = ["diagnosis_blocks", "render_md", "render_html", "write_reports"]

_COST = {"config": 0, "kernel": 1, "harness": 2}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _layers_cell(rec: dict | None) -> str:
    if not rec or not rec["layers"]:
        return "-"
    return "; ".join(
        f"L{layer['layer']}: {layer['needle_selected']} of {layer['needle_visible']} (rank {layer['best_rank']}/{layer['visible']})"
        for layer in rec["layers"]
    )


def _plots(inv: dict, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    sy = inv["symptom"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    series = [("reference", sy["recall_reference"]), ("candidate", sy["recall_candidate"])]
    series += [(f["name"], f["recall_by_length"]) for f in inv["fixes"]]
    for name, rec in series:
        xs = [int(n) for n in rec]
        ax.plot(xs, [rec[str(n)] for n in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("recall")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "recall.png", dpi=100)
    plt.close(fig)
    made.append(("recall.png", "Recall by length: reference, candidate and every replayed fix"))
    layers = inv["verdicts"]["signature"]["layers"]
    if layers and inv.get("candidate_records"):
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for layer in layers:
            us = sorted(
                rank_percentile(x["best_rank"], x["visible"], x["needle_visible"])
                for r in inv["candidate_records"]
                for x in r["layers"]
                if x["layer"] == layer["layer"]
            )
            if us:
                ax.step(
                    us,
                    [(i + 1) / len(us) for i in range(len(us))],
                    where="post",
                    label=f"layer {layer['layer']}",
                )
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="uniform (uninformative)")
        ax.set_xlabel("needle rank percentile u (0 = top)")
        ax.set_ylabel("fraction of cases")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "rank_percentiles.png", dpi=100)
        plt.close(fig)
        made.append(
            ("rank_percentiles.png", "Needle rank percentile per CSA layer (candidate) against U(0,1)")
        )
    return made


def diagnosis_blocks(inv: dict, images: list[tuple[str, str]]) -> list[tuple]:
    """The report as blocks: ("h", level, text) | ("p", text) | ("table", header, rows) | ("img", file, caption)."""
    v, sy = inv["verdicts"], inv["symptom"]
    by_id = {s["id"]: s for s in inv["suspects"]}
    b: list[tuple] = [("h", 1, "DIAGNOSIS")]
    b.append(
        (
            "p",
            f"Model `{inv['target']['model']}`. Reference `{sy['reference']}`; candidate (the deployment under suspicion) `{sy['candidate']}`. {sy['kind']} needles, {sy['cases']} cases ({len(sy['lengths'])} lengths x {len(sy['depths'])} depths x {sy['trials']} trials, seed {sy['seed']}), measured in-process on the reference checkpoint.",
        )
    )
    b.append(("h", 2, "Symptom"))
    rows = [
        [n, _pct(sy["recall_reference"].get(n)), _pct(sy["recall_candidate"].get(n))]
        for n in sy["recall_reference"]
    ]
    b.append(("table", ["length", "reference recall", "candidate recall"], rows))
    for name, caption in images[:1]:
        b.append(("img", name, caption))
    b.append(("h", 2, "Root cause"))
    root = v["root_cause"]
    if root:
        s = by_id[root]
        b.append(
            (
                "p",
                f"**{root}** (`{s['maps_to']}`; tier {s['tier']}: {s['hypothesis']}). Decisive measurement: {s['reason']}.",
            )
        )
    else:
        b.append(("p", "No suspect in the ledger is implicated as the root cause."))
    b.append(("h", 2, "Verdicts"))
    b.append(
        (
            "table",
            ["tier", "suspect", "in candidate", "verdict", "reason"],
            [
                [s["tier"], s["id"], "yes" if by_id[s["id"]]["present"] else "no", s["verdict"], s["reason"]]
                for s in v["suspects"]
            ],
        )
    )
    b.append(("h", 3, "Evidence"))
    ev_rows = []
    for s in v["suspects"]:
        for e in s["evidence"]:
            val = e["value"] if isinstance(e["value"], str) else f"{e['value']:.4g}"
            ev_rows.append(
                [
                    s["id"],
                    e["check"],
                    e["metric"],
                    val,
                    "-" if e["threshold"] is None else f"{e['threshold']:g}",
                ]
            )
    b.append(("table", ["suspect", "check", "metric", "value", "threshold"], ev_rows))
    b.append(("h", 2, "Signature: is the indexer's ranking informative about the needle?"))
    sig = v["signature"]
    lrows = [
        [
            ly["layer"],
            ly["n"],
            ly["population"],
            "-" if ly["ks_statistic"] is None else f"{ly['ks_statistic']:.3f}",
            "-" if ly["p_value"] is None else f"{ly['p_value']:.3g}",
            _pct(ly["median_percentile"]),
            "uninformative" if ly["uninformative"] else "informative",
        ]
        for ly in sig["layers"]
    ]
    b.append(("table", ["CSA layer", "n", "population", "KS D", "KS p", "median u", "ranking"], lrows))
    crow = [
        [
            c["index_topk"],
            c["capacity_tokens"],
            ", ".join(f"{n}: {x:.2f}" for n, x in c["recall"].items()),
            c["last_holding"] or "-",
            c["first_collapsed"] or "-",
            {True: "yes", False: "no", None: "not tested beyond capacity"}[c["consistent"]],
        ]
        for c in sig["collapse_vs_topk"]
    ]
    b.append(
        (
            "table",
            [
                "index_topk",
                "compress_ratio x index_topk",
                "recall by length",
                "holds to",
                "collapses at",
                "consistent",
            ],
            crow,
        )
    )
    bad = [ly["layer"] for ly in sig["layers"] if ly["uninformative"]]
    if sig["uninformative_ranking"]:
        b.append(
            (
                "p",
                f"**The rule fires.** The indexer's ranking is uninformative about the needle in CSA layer(s) {', '.join(map(str, bad))} (rank percentiles indistinguishable from U(0,1), or worse), and the collapse length tracks compress_ratio x index_topk (recall holds at >= {HOLD} exactly while the top-k covers every entry). The likely class is a functional indexer bug (cache layout or paging, scale handling, RoPE, masking), not precision; raising index_topk is a workaround.",
            )
        )
    else:
        why = []
        if not bad:
            why.append("every tested layer ranks the needle better than chance (or too few cases to test)")
        if not tracks_topk(sig["collapse_vs_topk"]):
            why.append("the collapse length does not track compress_ratio x index_topk in two runs")
        b.append(("p", "The rule does not fire: " + "; ".join(why) + "."))
    if len(images) > 1:
        b.append(("img", images[1][0], images[1][1]))
    ex = inv.get("explained")
    b.append(("h", 2, "Rank dump of the failing case"))
    if ex:
        c = ex["candidate"]
        b.append(
            (
                "p",
                f"Case `{ex['case_id']}` ({c['length']} tokens, depth {c['depth']:g}%): {ex['why']}. Expected `{' '.join(c['expected'])}`; the candidate answered `{c['answer']}`. Analysed at the {c['analysed_source']} (answer token {c['analysed_token']}, query position {c['layers'][0]['query_pos'] if c['layers'] else '-'}).",
            )
        )
        b.append(
            (
                "table",
                ["CSA layer", "needle entries selected", "best rank", "visible entries", "index_topk"],
                [
                    [
                        ly["layer"],
                        f"{ly['needle_selected']} of {ly['needle_visible']} visible",
                        ly["best_rank"],
                        ly["visible"],
                        c["index_topk"],
                    ]
                    for ly in c["layers"]
                ],
            )
        )
    else:
        b.append(("p", "The candidate answered every case correctly: there is no failing case to dump."))
    b.append(("h", 2, "Fixes, cheapest kind first"))
    fixes = sorted(inv["fixes"], key=lambda f: (_COST[f["changes"]], f["name"]))
    frows = []
    for f in fixes:
        p = f["pair"]
        k0 = inv["candidate_topk"]
        cost = (
            "none (same index_topk)"
            if f["keeps_topk"]
            else f"index_topk {k0} -> {f['index_topk']}: {f['index_topk'] / k0:g}x the entries each query attends"
        )
        frows.append(
            [
                f["label_kind"],
                f["changes"],
                f"`{f['label']}`",
                f"{p['recall_without']:.2f} vs {p['recall_with']:.2f}",
                f"b={p['b']} c={p['c']} p={p['p']:.3g}",
                cost,
                _layers_cell(f.get("case")),
            ]
        )
    b.append(
        (
            "table",
            [
                "label",
                "kind",
                "setting",
                "recall (fix vs candidate)",
                "paired test",
                "cost",
                "failing case: needle entries selected",
            ],
            frows,
        )
    )
    b.append(
        (
            "p",
            "Labels: root-cause fix = removes the root cause and restores recall at the deployment index_topk; workaround = restores recall while the cause stays (its cost given); no effect = no significant paired change (exact McNemar, p < 0.05). No harness-level fix was replayed.",
        )
    )
    blocked = [
        (s["id"], e["check"], e["value"])
        for s in v["suspects"]
        for e in s["evidence"]
        if isinstance(e["value"], str) and e["value"].startswith("blocked")
    ]
    unrun = [
        s["id"] for s in v["suspects"] if not by_id[s["id"]]["present"] and by_id[s["id"]]["pair"] is None
    ]
    b.append(("h", 2, "Blocked or unrun diagnostics"))
    lines = [f"{sid} {check}: {val}" for sid, check, val in blocked]
    if unrun:
        lines.append(
            "no ablation for suspects absent from the candidate (the ledger asks none): " + ", ".join(unrun)
        )
    b.append(("p", "; ".join(lines) if lines else "None."))
    b.append(("h", 2, "Provenance and reproduction"))
    b.append(
        (
            "p",
            f"Ledger `{inv['ledger']}`. Reproduce: `needlescope investigate run {inv['ledger']} --out DIR` (resumable). Artifacts: `verdicts.json`, `investigation.json`, `measure/*.jsonl` (one record per case and configuration), `state.json`.",
        )
    )
    return b


def _md_table(header, rows) -> list[str]:
    out = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def render_md(blocks: list[tuple]) -> str:
    out: list[str] = []
    for blk in blocks:
        if blk[0] == "h":
            out += ["#" * blk[1] + " " + blk[2], ""]
        elif blk[0] == "p":
            out += [blk[1], ""]
        elif blk[0] == "table":
            out += [*_md_table(blk[1], blk[2]), ""]
        elif blk[0] == "img":
            out += [f"![{blk[2]}]({blk[1]})", ""]
    return "\n".join(out)


def _inline(text: str) -> str:
    parts = html.escape(text).split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("**")
    return "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: list[tuple], images: dict[str, bytes]) -> str:
    body: list[str] = []
    for blk in blocks:
        if blk[0] == "h":
            body.append(f"<h{blk[1]}>{_inline(blk[2])}</h{blk[1]}>")
        elif blk[0] == "p":
            body.append(f"<p>{_inline(blk[1])}</p>")
        elif blk[0] == "table":
            head = "".join(f"<th>{_inline(str(c))}</th>" for c in blk[1])
            rows = "".join(
                "<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in r) + "</tr>" for r in blk[2]
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif blk[0] == "img":
            data = base64.b64encode(images[blk[1]]).decode()
            body.append(
                f'<figure><img alt="{html.escape(blk[2])}" src="data:image/png;base64,{data}"><figcaption>{html.escape(blk[2])}</figcaption></figure>'
            )
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#111;background:#fff}"
        "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #999;padding:3px 6px;vertical-align:top}"
        "th{background:#e8eef7}code{background:#f3f3f3}img{max-width:100%}"
    )
    return f"<!doctype html><html><head><meta charset='utf-8'><title>DIAGNOSIS</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n"


def write_reports(out: str | Path) -> tuple[Path, Path]:
    """Write DIAGNOSIS.md (+ its PNGs) and the self-contained DIAGNOSIS.html into ``out``."""
    out = Path(out)
    inv = json.loads((out / "investigation.json").read_text(encoding="utf-8"))
    cand = out / "measure" / "candidate.jsonl"
    inv["candidate_records"] = (
        [json.loads(x) for x in cand.read_text().splitlines() if x.strip()] if cand.exists() else []
    )
    images = _plots(inv, out) if inv["symptom"]["recall_candidate"] else []
    blocks = diagnosis_blocks(inv, images)
    md = out / "DIAGNOSIS.md"
    md.write_text(render_md(blocks), encoding="utf-8")
    page = out / "DIAGNOSIS.html"
    page.write_text(render_html(blocks, {n: (out / n).read_bytes() for n, _ in images}), encoding="utf-8")
    return md, page
