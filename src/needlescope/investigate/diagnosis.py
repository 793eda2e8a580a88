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

from needlescope.investigate import diagnosis_causal as dc
from needlescope.investigate.signature import NEAR_CHANCE, layer_percentiles

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
        for layer, us in sorted(layer_percentiles(inv["candidate_records"]).items()):
            us = sorted(us)
            ax.step(us, [(i + 1) / len(us) for i in range(len(us))], where="post", label=f"layer {layer}")
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
    live = inv.get("route") == "live"
    v = inv["verdicts"]
    b: list[tuple] = [("h", 1, "DIAGNOSIS"), ("p", _intro(inv, live))]
    b += dc.differences_blocks(v)
    b += _symptom_blocks(inv, images)
    b += _root_blocks(inv)
    b += dc.residual_blocks(v) + dc.localization_blocks(v)
    b += _verdict_blocks(inv, live)
    b += [("p", t) for t in [dc.multiplicity_text(v)] if t]
    b += dc.nonfinite_blocks(v)
    if live:
        b += _live_blocks(inv)
    else:
        b += _signature_blocks(inv["verdicts"]["signature"], images)
        b += _rankdump_blocks(inv.get("explained"))
        b += _fix_blocks(inv)
    b += _blocked_blocks(inv)
    b.append(("h", 2, "Provenance and reproduction"))
    b.append(
        (
            "p",
            f"Ledger `{inv['ledger']}`. Reproduce: `needlescope investigate run {inv['ledger']} --out DIR` (resumable). Artifacts: `verdicts.json`, `investigation.json`, `measure/*.jsonl` (one record per case and configuration), `state.json`.",
        )
    )
    return b


def _intro(inv: dict, live: bool) -> str:
    sy = inv["symptom"]
    where = (
        "the live endpoint probed over HTTP with its indexer capture, the reference in-process on the same token ids"
        if live
        else "measured in-process on the reference checkpoint"
    )
    return (
        f"Model `{inv['target']['model']}`. Reference `{sy['reference']}`; candidate (the deployment under "
        f"suspicion) `{sy['candidate']}`. {sy['kind']} needles, {sy['cases']} cases ({len(sy['lengths'])} lengths x "
        f"{len(sy['depths'])} depths x {sy['trials']} trials, seed {sy['seed']}), {where}."
    )


def _symptom_blocks(inv: dict, images) -> list[tuple]:
    sy = inv["symptom"]
    rows = [
        [n, _pct(sy["recall_reference"].get(n)), _pct(sy["recall_candidate"].get(n))]
        for n in sy["recall_reference"]
    ]
    b = [("h", 2, "Symptom"), ("table", ["length", "reference recall", "candidate recall"], rows)]
    if sy.get("errors"):
        b.append(("p", f"{sy['errors']} live request(s) failed; they are recorded as errors, not scored."))
    return b + [("img", name, caption) for name, caption in images[:1]]


def _root_blocks(inv: dict) -> list[tuple]:
    root = inv["verdicts"]["root_cause"]
    co = [s for s in inv["suspects"] if s["verdict"] == "implicated" and s.get("role") == "co-factor"]
    extra = [("p", f"Co-factor **{s['id']}** (`{s['maps_to']}`): {s['reason']}.") for s in co]
    if not root:
        return [
            ("h", 2, "Root cause"),
            ("p", "No suspect (ledger or automatic) is implicated as the root cause."),
            *extra,
        ]
    b = [("h", 2, "Root cause")]
    for rid in inv["verdicts"].get("root_causes") or [root]:
        s = next(x for x in inv["suspects"] if x["id"] == rid)
        b.append(
            (
                "p",
                f"**{rid}** (`{s['maps_to']}`; tier {s['tier']}: {s['hypothesis']}). Decisive measurement: {s['reason']}.",
            )
        )
    return b + extra


def _verdict_blocks(inv: dict, live: bool) -> list[tuple]:
    v = inv["verdicts"]
    by_id = {s["id"]: s for s in inv["suspects"]}
    present = {True: "yes", False: "no", None: "unknown (live)"}
    rows = [
        [s["tier"], s["id"], present[by_id[s["id"]]["present"]], s["verdict"], s["reason"]]
        for s in v["suspects"]
    ]
    ev_rows = [
        [
            s["id"],
            e["check"],
            e["metric"],
            e["value"] if isinstance(e["value"], str) else f"{e['value']:.4g}",
            "-" if e["threshold"] is None else f"{e['threshold']:g}",
        ]
        for s in v["suspects"]
        for e in s["evidence"]
    ]
    return [
        ("h", 2, "Verdicts"),
        ("table", ["tier", "suspect", "in candidate", "verdict", "reason"], rows),
        ("h", 3, "Evidence"),
        ("table", ["suspect", "check", "metric", "value", "threshold"], ev_rows),
    ]


def _signature_blocks(sig: dict, images) -> list[tuple]:
    lrows = [
        [
            ly["layer"],
            ly["n"],
            _pct(ly["mean_percentile"]),
            "-" if ly["mean_lower"] is None else f"[{ly['mean_lower']:.2f}, {ly['mean_upper']:.2f}]",
            _pct(ly["median_percentile"]),
            f"{ly['p_better_holm']:.3g}",
            f"{ly['p_near_chance_holm']:.3g}",
            f"{ly['p_worse_holm']:.3g}",
            ly["ranking"],
        ]
        for ly in sig["layers"]
    ]
    crow = [
        [
            c["index_topk"],
            c["capacity_tokens"],
            ", ".join(
                f"{x['length']}: {x['correct']}/{x['n']} [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}] {x['state']}"
                for x in c["lengths"]
            ),
            c["last_holding"] or "-",
            c["first_collapsed"] or "-",
            {True: "yes", False: "no", None: "cannot decide"}[c["consistent"]],
        ]
        for c in sig["collapse_vs_topk"]
    ]
    head = [
        "index_topk",
        "compress_ratio x index_topk",
        "recall by length (Wilson 95%)",
        "holds to",
        "collapses at",
        "consistent",
    ]
    lhead = [
        "CSA layer",
        "n",
        "mean u",
        "90% CI",
        "median u",
        "p better",
        "p near chance",
        "p worse",
        "ranking",
    ]
    b = [
        ("h", 2, "Signature: is the indexer's ranking informative about the needle?"),
        (
            "p",
            f"Population: {sig['layers'][0]['population'] if sig['layers'] else 'none measured'}. "
            f"Percentile u: 0 = the needle ranks first, uniform on (0, 1) under a random ranking. "
            f"p-values exact (sum of percentiles) or t (near chance: mean u >= {0.5 - NEAR_CHANCE:.2f}), "
            "Holm-corrected across layers.",
        ),
        ("table", lhead, lrows),
        ("table", head, crow),
        ("p", _signature_text(sig)),
    ]
    return b + [("img", name, caption) for name, caption in images[1:2]]


def _signature_text(sig: dict) -> str:
    bad = [ly["layer"] for ly in sig["layers"] if ly["uninformative"]]
    excluded = [ly["layer"] for ly in sig["layers"] if ly["ranking"] == "excluded"]
    fix = (
        "raising index_topk is a workaround (a larger index_topk was measured to restore recall)"
        if sig["topk_fix"]["restores"]
        else "no larger index_topk was measured to restore recall, so raising it is not a known workaround"
    )
    out = []
    if excluded:
        out.append(
            f"**The needle is systematically excluded** in CSA layer(s) {', '.join(map(str, excluded))}: its rank percentiles sit near 1, significantly worse than chance. The likely bug classes are masking, validity flags or dropped candidates."
        )
    if sig["uninformative_ranking"]:
        out.append(
            f"**The rule fires.** The indexer's ranking is within {NEAR_CHANCE} of chance in CSA layer(s) {', '.join(map(str, bad))}, and the collapse length tracks compress_ratio x index_topk ({sig['collapse']['reason']}). The likely class is a functional indexer bug (cache layout or paging, scale handling, RoPE, masking), not precision; {fix}."
        )
        return " ".join(out)
    why = []
    if not bad:
        undecided = [ly for ly in sig["layers"] if ly["ranking"] == "undecided"]
        why.append(
            f"no layer's ranking is bounded near chance ({len(undecided)} layer(s) undecided: about {undecided[0]['cases_needed']} cases a layer would decide)"
            if undecided
            else "no layer's ranking is bounded near chance"
        )
    if sig["collapse"]["tracks"] is not True:
        why.append(f"the collapse: {sig['collapse']['reason']}")
    out.append("The rule does not fire: " + "; ".join(why) + f"; {fix}.")
    return " ".join(out)


def _rankdump_blocks(ex: dict | None) -> list[tuple]:
    b: list[tuple] = [("h", 2, "Rank dump of the failing case")]
    if not ex:
        return b + [("p", "The candidate answered every case correctly: there is no failing case to dump.")]
    c = ex["candidate"]
    qpos = c["layers"][0]["query_pos"] if c["layers"] else "-"
    b.append(
        (
            "p",
            f"Case `{ex['case_id']}` ({c['length']} tokens, depth {c['depth']:g}%): {ex['why']}. Expected `{' '.join(c['expected'])}`; the candidate answered `{c['answer']}`. Analysed at the {c['analysed_source']} (answer token {c['analysed_token']}, query position {qpos}).",
        )
    )
    rows = [
        [
            ly["layer"],
            f"{ly['needle_selected']} of {ly['needle_visible']} visible",
            ly["best_rank"],
            ly["visible"],
            c["index_topk"],
        ]
        for ly in c["layers"]
    ]
    return b + [
        (
            "table",
            ["CSA layer", "needle entries selected", "best rank", "visible entries", "index_topk"],
            rows,
        )
    ]


def _fix_blocks(inv: dict) -> list[tuple]:
    k0 = inv["candidate_topk"]
    frows = []
    for f in sorted(inv["fixes"], key=lambda f: (_COST[f["changes"]], f["name"])):
        p = f["pair"]
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
    head = [
        "label",
        "kind",
        "setting",
        "recall (fix vs candidate)",
        "paired test",
        "cost",
        "failing case: needle entries selected",
    ]
    return [
        ("h", 2, "Fixes, cheapest kind first"),
        ("table", head, frows),
        (
            "p",
            "Labels: root-cause fix = removes the root cause and restores recall at the deployment index_topk; workaround = restores recall while the cause stays (its cost given); no effect = no significant paired change (exact McNemar, p < 0.05). No harness-level fix was replayed.",
        ),
    ]


def _live_blocks(inv: dict) -> list[tuple]:
    sy = inv["symptom"]
    rows = [
        [
            s["id"],
            s["verdict"],
            f"{s['live']['reproduced']} of {s['live']['failures']}",
            f"{s['live']['jaccard_emulation']:.3f}",
            f"{s['live']['jaccard_baseline']:.3f}",
            f"{s['live']['needle_emulation']} / {s['live']['needle_live']} / {s['live']['needle_baseline']} of {s['live']['needle_visible']}",
        ]
        for s in inv["suspects"]
        if s.get("live")
    ]
    head = [
        "suspect",
        "verdict",
        "selection failures reproduced",
        "Jaccard emulation vs live",
        "Jaccard baseline vs live",
        "needle entries selected: emulation / live / baseline",
    ]
    return [
        ("h", 2, "Live selection vs each suspect's emulation"),
        (
            "p",
            f"The live endpoint cannot be ablated, so each suspect is emulated in the reference at the live index_topk ({sy.get('live_index_topk')}) on the live token ids of the {sy.get('failing_cases', 0)} failing case(s) (wrong live, right under the reference), and its top-k compared with the live capture per CSA layer; the baseline is the reference at the same index_topk with nothing added. No fix is replayed on a live endpoint, and the rank signature needs scores the capture does not hold.",
        ),
        ("table", head, rows),
    ]


def _blocked_blocks(inv: dict) -> list[tuple]:
    v = inv["verdicts"]
    by_id = {s["id"]: s for s in inv["suspects"]}
    lines = [
        f"{s['id']} {e['check']}: {e['value']}"
        for s in v["suspects"]
        for e in s["evidence"]
        if isinstance(e["value"], str) and e["value"].startswith("blocked")
    ]
    lines += [f"{s['id']}: {s['reason']}" for s in v["suspects"] if s["verdict"] == "blocked"]
    unrun = [
        s["id"]
        for s in v["suspects"]
        if by_id[s["id"]]["present"] is False
        and by_id[s["id"]]["pair"] is None
        and not by_id[s["id"]].get("live")
    ]
    if unrun:
        lines.append(
            "no causal check for suspects absent from the candidate (the ledger asks none; their exoneration rests on the configuration check and cheap questions): "
            + ", ".join(unrun)
        )
    return [("h", 2, "Blocked or unrun diagnostics"), ("p", "; ".join(lines) if lines else "None.")]


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
