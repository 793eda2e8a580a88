"""DIAGNOSIS.md and DIAGNOSIS.html of an investigation run, from its ``Findings`` only.

Both are rendered from one list of blocks (heading, paragraph, table, image), so they say the
same thing; the HTML embeds the plots as data URIs and needs no other file. Every conclusion
is printed next to the measurement it rests on.
"""

from __future__ import annotations

import datetime
import itertools
from pathlib import Path

import needlescope
from needlescope.investigate.decide.findings import Findings, Suspect
from needlescope.investigate.decide.signature import NEAR_CHANCE, layer_percentiles
from needlescope.investigate.decide.verdicts import ALPHA, fix_label
from needlescope.investigate.report import causal as dc
from needlescope.investigate.report.characterization import characterization_blocks
from needlescope.investigate.report.summary import COST_ORDER, shown_verdict, summary_box
from needlescope.report.blocks import render_html, render_md

__all__ = ["diagnosis_blocks", "render_md", "render_html", "write_reports"]


def _pct(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _layers_cell(rec: dict | None) -> str:
    if not rec or not rec["layers"]:
        return "-"
    return "; ".join(
        f"L{layer['layer']}: {layer['needle_selected']} of {layer['needle_visible']} (rank {layer['best_rank']}/{layer['visible']})"
        for layer in rec["layers"]
    )


# Fix curves never take the reference's blue or the candidate's red.
_FIX_COLOURS = ("#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")


FIX_OFFSET = 0.035
"""The n-th fix curve is drawn ``n x FIX_OFFSET`` below its values (said in its legend entry): a
fix that equals the reference (or another fix) would otherwise hide under its line."""


def _recall_curves(ax, findings: Findings) -> None:
    """Reference and candidate drawn thick and pale, each fix dashed and solid-coloured over them,
    offset downwards by ``FIX_OFFSET`` a fix so that a fix equal to the reference at 1.0 (or to
    another fix) stays visible beside it, on a linear length axis ticked at the tested lengths."""
    sy = findings.symptom
    for i, (f, colour) in enumerate(zip(findings.fixes, itertools.cycle(_FIX_COLOURS))):
        rec, dy = f["recall_by_length"], -FIX_OFFSET * (i + 1)
        xs = [int(n) for n in rec]
        ax.plot(
            xs, [rec[str(n)] + dy for n in xs], lw=2.4, ls=(0, (4, 2)), marker="D", ms=5,
            label=f"{f['name']}: {fix_label(f)} (drawn {dy:+.3f})", zorder=6, color=colour,
        )  # fmt: skip
    for name, rec, colour in (
        ("reference", sy["recall_reference"], "#1f5fbf"),
        ("candidate", sy["recall_candidate"], "#d62728"),
    ):
        xs = [int(n) for n in rec]
        ax.plot(
            xs,
            [rec[str(n)] for n in xs],
            lw=5,
            marker="o",
            ms=8,
            color=colour,
            alpha=0.55,
            label=name,
            zorder=5,
        )
    lengths = sorted({int(n) for n in sy["recall_reference"]} | {int(n) for n in sy["recall_candidate"]})
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_xlim(0, max(lengths) * 1.05 if lengths else 1)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("recall")
    ax.set_ylim(-0.05 - FIX_OFFSET * len(findings.fixes), 1.05)
    ax.set_title(f"Recall by length: candidate vs reference ({sy['cases']} {sy['kind']} cases)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, never on them


def _plots(findings: Findings, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(10, 3.8))
    _recall_curves(ax, findings)
    fig.tight_layout()
    fig.savefig(out / "recall.png", dpi=100)
    plt.close(fig)
    fixes = (  # a live run replays none
        f", each replayed fix (dashed, the n-th drawn n x {FIX_OFFSET} below its values)"
        if findings.fixes
        else ""
    )
    made.append(("recall.png", f"Recall by length: reference and candidate (thick){fixes}"))
    layers = findings.signature["layers"]
    if layers and findings.candidate_records:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for layer, us in sorted(layer_percentiles(list(findings.candidate_records)).items()):
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


def diagnosis_blocks(findings: Findings, images: list[tuple[str, str]]) -> list[tuple]:
    """The report as blocks: ("h", level, text) | ("p", text) | ("table", header, rows) | ("img", file, caption)."""
    f = findings
    live = f.route == "live"
    v = f.verdicts
    b: list[tuple] = [("h", 1, "DIAGNOSIS"), summary_box(f), ("p", _intro(f, live))]
    b += dc.differences_blocks(v)
    b += _symptom_blocks(f, images)
    b += _root_blocks(f)
    b += dc.residual_blocks(v) + dc.localization_blocks(v) + characterization_blocks(v)
    b += _verdict_blocks(f)
    b += [("p", t) for t in [dc.multiplicity_text(v)] if t]
    b += dc.nonfinite_blocks(v)
    if live:
        b += _live_blocks(f)
    elif f.route not in (
        "dump",
        "blackbox",
    ):  # nothing ran the candidate here: no signature, rank dump or fixes
        b += _signature_blocks(f.signature, images)
        b += _rankdump_blocks(f.explained)
        b += rank_paths_blocks(f.rank_paths)
        b += _fix_blocks(f)
    b += _blocked_blocks(f)
    b.append(_evidence_block(f))
    b.append(("h", 2, "Provenance and reproduction"))
    b.append(
        (
            "p",
            f"Ledger `{f.ledger}`. Reproduce: `needlescope investigate run {f.ledger} --out DIR` (resumable). Artifacts: `verdicts.json`, `investigation.json`, `measure/*.jsonl` (one record per case and configuration), `state.json`.",
        )
    )
    return b


def _intro(findings: Findings, live: bool) -> str:
    sy = findings.symptom
    where = (
        "the live endpoint probed over HTTP with its indexer capture, the reference in-process on the same token ids"
        if live
        else "measured in-process on the reference checkpoint"
    )
    if findings.route == "dump":
        where += "; the candidate is the engine's tensor dump of one request, compared with the reference on its token ids"
    if findings.route == "blackbox":
        where = "the endpoint read from outside (its answers and prompt logprobs; it has no indexer capture), no model run here"
    return (
        f"Model `{findings.target['model']}`. Reference `{sy['reference']}`; candidate (the deployment under "
        f"suspicion) `{sy['candidate']}`. {sy['kind']} needles, {sy['cases']} cases ({len(sy['lengths'])} lengths x "
        f"{len(sy['depths'])} depths x {sy['trials']} trials, seed {sy['seed']}), {where}."
    )


def _symptom_blocks(findings: Findings, images) -> list[tuple]:
    sy = findings.symptom
    rows = [
        [n, _pct(sy["recall_reference"].get(n)), _pct(sy["recall_candidate"].get(n))]
        for n in sy["recall_reference"]
    ]
    b = [("h", 2, "Symptom"), ("table", ["length", "reference recall", "candidate recall"], rows)]
    if sy.get("errors"):
        b.append(("p", f"{sy['errors']} live request(s) failed; they are recorded as errors, not scored."))
    return b + [("img", name, caption) for name, caption in images[:1]]


def _root_blocks(findings: Findings) -> list[tuple]:
    root = findings.root_cause
    co = [s for s in findings.suspects if s.verdict == "implicated" and s.role == "co-factor"]
    extra = [("p", f"Co-factor **{s.id}** (`{s.maps_to}`): {s.reason}.") for s in co]
    if not root:
        return [
            ("h", 2, "Root cause"),
            ("p", "No suspect (ledger or automatic) is implicated as the root cause."),
            *extra,
        ]
    b = [("h", 2, "Root cause")]
    for rid in findings.root_causes or [root]:
        s = findings.suspect(rid)
        b.append(
            (
                "p",
                f"**{rid}** (`{s.maps_to}`; tier {s.tier}: {s.hypothesis}). Decisive measurement: {s.reason}.",
            )
        )
    return b + extra


def _verdict_blocks(findings: Findings) -> list[tuple]:
    present = {True: "yes", False: "no", None: f"unknown ({findings.route})"}
    rows = [[s.tier, s.id, present[s.present], shown_verdict(s), s.reason] for s in findings.suspects]
    return [
        ("h", 2, "Verdicts"),
        ("table", ["tier", "suspect", "in candidate", "verdict", "reason"], rows),
    ]


def _evidence_block(findings: Findings) -> tuple:
    """Every measurement behind the verdicts, folded: it is long (one row per audit metric and
    question answer) and the verdicts above already quote the decisive ones."""
    rows = [
        [
            s.id,
            e["check"],
            e["metric"],
            e["value"] if isinstance(e["value"], str) else f"{e['value']:.4g}",
            "-" if e["threshold"] is None else f"{e['threshold']:g}",
        ]
        for s in findings.suspects
        for e in s.evidence
    ]
    table = ("table", ["suspect", "check", "metric", "value", "threshold"], rows)
    return ("details", f"Evidence: {len(rows)} measurements behind the verdicts (click to open)", [table])


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


def _stat_cells(st: dict | None) -> list:
    if st is None:
        return ["-", "-", "-"]
    return [st["needle_selected"], st["best_rank"], f"{st['percentile']:.2f}"]


def rank_paths_blocks(rp: dict | None) -> list[tuple]:
    """The failing case's rank statistics on both paths (``verdicts.json`` ``rank_paths``)."""
    if not rp:
        return []
    rows = [
        [
            ly["layer"],
            path,
            *_stat_cells(ly[path]),
            *_stat_cells(ly[f"reference_{path}"])[:2],
            "yes" if ly[f"{path}_same_as_reference"] else "no",
        ]
        for ly in rp["layers"]
        for path in ("prefill", "decode")
    ]
    return [
        ("h", 3, "Both paths: teacher-forced prefill and the server's decode"),
        (
            "p",
            f"The same token ids (prompt and answer up to answer token {rp['analysed_token']}, query position {rp['query_pos']}) run teacher-forced (prefill) and the way a server runs them (the prompt prefilled into the cache, the answer decoded one token per forward), under the candidate and under the reference `{rp['reference']}`. Diverges first: **{rp['diverges_first']}**: {rp['summary']}.",
        ),
        (
            "table",
            [
                "CSA layer",
                "path",
                "needle entries selected",
                "best rank",
                "percentile",
                "reference: selected",
                "reference: best rank",
                "same selection as the reference",
            ],
            rows,
        ),
    ]


_LABEL_ORDER = {"root-cause fix": 0, "workaround": 1, "no effect": 2}


def _fix_change(f: dict, k0: int) -> str:
    if f.get("removes"):
        return f"remove {f['removes']}"
    return f"index_topk {k0} -> {f['index_topk']}" if not f["keeps_topk"] else "-"


def _fix_blocks(findings: Findings) -> list[tuple]:
    k0 = findings.candidate_topk
    frows = []
    order = lambda f: (_LABEL_ORDER.get(f["label_kind"], 3), COST_ORDER[f["changes"]], f["name"])  # noqa: E731
    for f in sorted(findings.fixes, key=order):
        p = f["pair"]
        cost = (
            "none (same index_topk)"
            if f["keeps_topk"]
            else f"index_topk {k0} -> {f['index_topk']}: {f['index_topk'] / k0:g}x the entries each query attends"
        )
        label = f"**{f['label_kind']}**" if f["label_kind"] != "no effect" else fix_label(f)
        frows.append(
            [
                label,
                _fix_change(f, k0),
                f"{p['recall_without']:.2f} vs {p['recall_with']:.2f}",
                f"b={p['b']} c={p['c']} p={p['p']:.3g}",
                cost,
                f["changes"],
                f"`{f['label']}`",
                _layers_cell(f.get("case")),
            ]
        )
    head = [
        "label",
        "change",
        "recall (fix vs candidate)",
        "paired test",
        "cost",
        "kind",
        "setting",
        "failing case: needle entries selected",
    ]
    return [
        (
            "h",
            2,
            "Fixes: root-cause fix first, then workarounds, then those that restore nothing significantly (cheapest kind first within each)",
        ),
        ("table", head, frows),
        (
            "p",
            f"Labels: root-cause fix = removes the root cause and restores recall at the deployment index_topk; workaround = restores recall while the cause stays (its cost given); not significant = no significant paired change (exact McNemar, p < {ALPHA}; its p and paired n given), worse = significantly fewer cases right. No harness-level fix was replayed.",
        ),
    ]


def _decode_cell(s: Suspect) -> str:
    """The decode-path emulation's numbers of a live suspect ("-" for runs before both paths)."""
    lp = s.live_paths
    if not lp:
        return "-"
    d = lp["decode"]
    return f"{d['reproduced']} of {d['failures']}, Jaccard {d['jaccard_emulation']:.3f} (baseline {d['jaccard_baseline']:.3f})"


def _live_blocks(findings: Findings) -> list[tuple]:
    sy = findings.symptom
    rows = [
        [
            s.id,
            s.verdict,
            f"{s.live['reproduced']} of {s.live['failures']}",
            f"{s.live['jaccard_emulation']:.3f}",
            f"{s.live['jaccard_baseline']:.3f}",
            f"{s.live['needle_emulation']} / {s.live['needle_live']} / {s.live['needle_baseline']} of {s.live['needle_visible']}",
            _decode_cell(s),
            (s.live_paths or {}).get("decided_by", "prefill"),
        ]
        for s in findings.suspects
        if s.live
    ]
    head = [
        "suspect",
        "verdict",
        "selection failures reproduced",
        "Jaccard emulation vs live",
        "Jaccard baseline vs live",
        "needle entries selected: emulation / live / baseline",
        "decode path: failures reproduced, Jaccard",
        "decided by",
    ]
    return [
        ("h", 2, "Live selection vs each suspect's emulation"),
        (
            "p",
            f"The live endpoint cannot be ablated, so each suspect is emulated in the reference at the live index_topk ({sy.get('live_index_topk')}) on the live token ids of the {sy.get('failing_cases', 0)} failing case(s) (wrong live, right under the reference), and its top-k compared with the live capture per CSA layer; the baseline is the reference at the same index_topk with nothing added. Both paths run: teacher-forced (prefill) and the server's own (the prompt prefilled into the cache, the answer decoded one token per forward); the first columns are the path that decides the verdict (the teacher-forced one unless only the decode path reproduces the live failure: decode-path only). No fix is replayed on a live endpoint, and the rank signature needs scores the capture does not hold.",
        ),
        ("table", head, rows),
    ]


def _blocked_blocks(findings: Findings) -> list[tuple]:
    lines = [
        f"{s.id} {e['check']}: {e['value']}"
        for s in findings.suspects
        for e in s.evidence
        if isinstance(e["value"], str) and e["value"].startswith("blocked")
    ]
    lines += [f"{s.id}: {s.reason}" for s in findings.suspects if s.verdict == "blocked"]
    unrun = [s.id for s in findings.suspects if s.present is False and s.pair is None and not s.live]
    if unrun:
        lines.append(
            "no causal check for suspects absent from the candidate (the ledger asks none; their exoneration rests on the configuration check and cheap questions): "
            + ", ".join(unrun)
        )
    return [("h", 2, "Blocked or unrun diagnostics"), ("p", "; ".join(lines) if lines else "None.")]


def _footer(findings: Findings, command: str | None) -> tuple:
    digest = findings.ledger_sha256
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # no absolute path of this machine in an artifact: the run directory by its name
    cmd = command or f"needlescope investigate run {findings.ledger} --out {Path(findings.out).name}"
    return (
        "footer",
        f"Rendered {when} by needlescope {needlescope.__version__}. Command: `{cmd}`. Ledger "
        f"`{findings.ledger}`, sha256 `{digest or 'unknown (no state.json)'}`.",
    )


def write_reports(findings: Findings, command: str | None = None) -> tuple[Path, Path]:
    """Write DIAGNOSIS.md (+ its PNGs) and the self-contained DIAGNOSIS.html into the run
    directory, from ``findings`` only (``run_investigation``'s value, or ``Findings.read(out)``).

    ``command``: the command line that ran the investigation, for the footer (default: the
    command that reproduces it)."""
    out = Path(findings.out)
    images = _plots(findings, out) if findings.symptom["recall_candidate"] else []
    blocks = diagnosis_blocks(findings, images) + [_footer(findings, command)]
    md = out / "DIAGNOSIS.md"
    md.write_text(render_md(blocks), encoding="utf-8")
    page = out / "DIAGNOSIS.html"
    page.write_text(render_html(blocks, {n: (out / n).read_bytes() for n, _ in images}), encoding="utf-8")
    return md, page
