"""DIAGNOSIS.md: the recall failure of a deployment setting told in numbers.

Reads only documented artifacts: two probe summaries (``SUMMARY_SCHEMA``), a rank dump of
the failing case (``RANKDUMP_SCHEMA``) and the fix candidates' rank-dump digests. Embeds
the two heatmaps written by the probes (by default ``reference/heatmap.png`` and
``deployment/heatmap.png``, relative to the report).
"""

from __future__ import annotations

from pathlib import Path

from needlescope.analysis.curve import pool_by_length
from needlescope.report.blocks import render_md

__all__ = ["write_diagnosis", "render_diagnosis", "recall_by_length", "recall_fall_line"]


def recall_by_length(summary: dict) -> dict[int, float]:
    """Recall per length of a probe summary (``SUMMARY_SCHEMA``), pooled over depths."""
    pooled = pool_by_length((c["length"], c["correct"], c["n"]) for c in summary["cells"])
    return {length: (k / n if n else float("nan")) for length, (k, n) in pooled.items()}


def recall_fall_line(reference: dict, candidate: dict, name: str = "candidate") -> str:
    """One line: from which length ``candidate`` recalls less than ``reference``, and both curves.

    ``reference``/``candidate``: length (int or str) -> recall, in length order."""

    def fmt(rec: dict) -> str:
        return ", ".join(f"{x:.2f}" for x in rec.values())

    lost = [n for n in reference if n in candidate and candidate[n] < reference[n]]
    where = (
        f"recall falls from {int(lost[0]):,} tokens on" if lost else "no recall lost against the reference"
    )
    lengths = ", ".join(f"{int(n):,}" for n in reference)
    return f"{where}: {name} {fmt(candidate)} vs reference {fmt(reference)} at {lengths} tokens"


def _fmt_len(x: int | None) -> str:
    return "none (below threshold at every length)" if x is None else f"{x} tokens"


def render_diagnosis(
    *,
    model: str,
    reference: dict,
    deployment: dict,
    deployment_label: str,
    case: dict,
    why: str,
    rankdump: dict,
    fixes: list[dict],
    deployment_patch: str | None = None,
    heatmaps: tuple[str, str] = ("reference/heatmap.png", "deployment/heatmap.png"),
) -> str:
    """The Markdown text of DIAGNOSIS.md; ``heatmaps`` are the probes' heatmap paths relative to it.

    ``deployment_patch`` (the deployment's patch spec, if any) tells a fix that removes the patch
    from one that restores the case while the patch stays in (a workaround).
    """
    dropped = _dropped_layers(rankdump)
    box = _summary_box(
        recall_fall_line(recall_by_length(reference), recall_by_length(deployment), "deployment"),
        case,
        rankdump,
        fixes,
        dropped,
        deployment_patch,
    )
    lines = [
        "# DIAGNOSIS",
        "",
        render_md([box]),
        f"Model: `{model}`. Deployment setting under test: `{deployment_label}`; reference: fp32 indexer "
        "with the checkpoint's own `index_topk`.",
        "",
        *_collapse_section(reference, deployment, heatmaps),
        *_layer_section(case, why, rankdump, dropped),
        *_fix_section(fixes, dropped, deployment_patch),
        "",
        f"Artifacts: `{Path(heatmaps[0]).parent}/` and `{Path(heatmaps[1]).parent}/` (probe outputs), "
        "`rankdump.json`, `fixes.json`.",
        "",
    ]
    return "\n".join(lines)


def _collapse_section(reference: dict, deployment: dict, heatmaps: tuple[str, str]) -> list[str]:
    ref_len, dep_len = recall_by_length(reference), recall_by_length(deployment)
    lines = [
        "## Where recall collapses",
        "",
        "| length | reference recall | deployment recall |",
        "|---|---|---|",
    ]
    for n in ref_len:
        lines.append(f"| {n} | {ref_len[n]:.2f} | {dep_len.get(n, float('nan')):.2f} |")
    lines += [
        "",
        f"Effective length (recall >= {reference['threshold']:.2f}): reference {_fmt_len(reference['effective_length'])}, "
        f"deployment {_fmt_len(deployment['effective_length'])}.",
    ]
    if deployment.get("cliff"):
        c = deployment["cliff"]
        lines.append(f"Deployment cliff: {c['from']} -> {c['to']} tokens, recall drops by {c['drop']:.2f}.")
    if max(ref_len.values(), default=0.0) == 0.0:
        lines += [
            "",
            "**The reference numerics recall nothing either: the checkpoint itself cannot retrieve these "
            "needles, so no deployment setting is to blame.**",
        ]
    return lines + [
        "",
        "| reference | deployment |",
        "|---|---|",
        f"| ![reference]({heatmaps[0]}) | ![deployment]({heatmaps[1]}) |",
        "",
    ]


def _summary_box(
    symptom: str, case: dict, rankdump: dict, fixes: list[dict], dropped: list, patch: str | None
):
    """The ``report.blocks`` summary box: what one rank-dumped case shows, and what to do."""
    working = [f for f in fixes if f["selected_all_layers"] and f["answer_correct"]]
    restoring = [f for f in fixes if f["answer_correct"]]
    root = [f for f in working if _fix_kind(f, patch) == "removes the patch"]
    around = [f for f in working if _fix_kind(f, patch) == "patch stays in"] if root else []
    one = (
        f"case `{case['case_id']}`, one case: evidence, not a verdict (`needlescope investigate` measures it)"
    )
    if root:
        cause = f"likely the patch `{patch}`: removing it restores selection and the answer on {one}"
    elif dropped:
        layer, p = dropped[0]
        cause = (
            f"the indexer's top-k drops the needle in CSA layer {layer} (best entry rank {p['best_rank']} of "
            f"{p['visible_entries']}, k = {rankdump['index_topk']}) on {one}"
        )
        cause += "" if working else "; **unexplained** beyond that: no candidate restores it"
    elif restoring:
        cause = f"not the top-k cutoff (the needle was selected in every CSA layer); `{restoring[0]['label']}` restores the answer on {one}"
    else:
        cause = (
            "**unexplained**: the needle was selected in every CSA layer and no candidate restores the answer"
        )
    best = (root or working or restoring or [None])[0]
    fix = (
        f"`{best['label']}` ({_fix_kind(best, patch)}): it restores "
        + ("selection and the answer" if best["selected_all_layers"] else "the answer")
        + f" on case `{case['case_id']}`"
        if best
        else "none found among the candidates; widen the sweep (`needlescope indexer sweep`)"
    )
    avoid = "; ".join(
        f"`{f['label']}` is a workaround: it restores this case while the patch stays in" for f in around
    )
    rows = [
        ("Symptom", symptom),
        ("Root cause", cause),
        ("Recommended fix", fix),
        ("Not a fix", avoid or "-"),
    ]
    return ("box", "Summary", rows)


def _dropped_layers(rankdump: dict) -> list[tuple[int, dict]]:
    """(layer, first position) of each CSA layer whose top-k missed every needle entry."""
    return [
        (layer["layer"], layer["positions"][0])
        for layer in rankdump["layers"]
        if layer["positions"] and not layer["positions"][0]["selected"]
    ]


def _layer_section(case: dict, why: str, rankdump: dict, dropped: list[tuple[int, dict]]) -> list[str]:
    lines = [
        "## Which layer's indexer drops the needle",
        "",
        f"Case `{case['case_id']}` ({case['length']} tokens, depth {case['depth']:g}%): {why}. "
        f"Expected `{', '.join(case['expected'])}`; the deployment answered `{rankdump.get('generated_text', '').strip()}`.",
        "",
        "| CSA layer | needle entries visible | best rank | k | margin (needle - cutoff) | margin / spread | selected |",
        "|---|---|---|---|---|---|---|",
    ]
    for layer in rankdump["layers"]:
        if not layer["positions"]:
            lines.append(f"| {layer['layer']} | none yet | - | - | - | - | - |")
            continue
        p = layer["positions"][0]
        frac = p.get("margin_frac")
        lines.append(
            f"| {layer['layer']} | {len(p['needle_entries'])} of {p['visible_entries']} | {p['best_rank']} | "
            f"{rankdump['index_topk']} | {p['margin']:+.4g} | {'-' if frac is None else f'{frac:+.3f}'} | "
            f"{'yes' if p['selected'] else '**no**'} |"
        )
    lines += _nonfinite_lines(rankdump)
    if not dropped:
        return lines + [
            "",
            "Every CSA layer selected a needle entry at the first answer position: the top-k cutoff did not drop "
            "the needle here.",
            "",
        ]
    layer, p = dropped[0]
    return lines + [
        "",
        f"At the position that produces the first answer token, layer {layer}'s indexer ranks the needle's best "
        f"entry {p['best_rank']} of {p['visible_entries']} with k = {rankdump['index_topk']}: it falls "
        f"{-p['margin']:.4g} below the cutoff, so that layer's sparse attention never reads the needle.",
        "",
    ]


def _nonfinite_lines(rankdump: dict) -> list[str]:
    """The non-finite indexer scores the rank dump counted (at the analysed positions), if any."""
    rows = [
        (layer["layer"], p["nonfinite"])
        for layer in rankdump["layers"]
        for p in layer["positions"]
        if p.get("nonfinite")
    ]
    if not rows:
        return []
    parts = [f"layer {n}: {c['neg_inf']} -inf, {c['nan']} NaN, {c['pos_inf']} +inf" for n, c in rows]
    return [
        "",
        "Non-finite indexer scores among the visible entries at the analysed position ("
        + "; ".join(parts)
        + "): -inf and NaN rank last, +inf first; NaN or +inf is a finding in itself.",
    ]


def _fix_kind(fix: dict, deployment_patch: str | None) -> str:
    if deployment_patch is not None and fix.get("patch") is None:
        return "removes the patch"
    if deployment_patch is not None:
        return "patch stays in"
    return "setting change"


def _fix_section(fixes: list[dict], dropped: list, deployment_patch: str | None) -> list[str]:
    lines = [
        "## Which fix restores it",
        "",
        "| setting | what it changes | needle selected in every CSA layer | answer correct |",
        "|---|---|---|---|",
    ]
    for f in fixes:
        ok = f["answer_correct"]
        lines.append(
            f"| `{f['label']}` | {_fix_kind(f, deployment_patch)} | {'yes' if f['selected_all_layers'] else 'no'} | "
            f"{'-' if ok is None else ('yes' if ok else 'no')} |"
        )
    return lines + ["", _fix_conclusion(fixes, dropped, deployment_patch)]


def _fix_conclusion(fixes: list[dict], dropped: list, deployment_patch: str | None) -> str:
    working = [f for f in fixes if f["selected_all_layers"] and f["answer_correct"]]
    selecting = [f for f in fixes if f["selected_all_layers"]]
    restoring = [f for f in fixes if f["answer_correct"]]
    if not dropped and restoring:
        return (
            "The deployment selected a needle entry in every CSA layer and still answered wrong, so the top-k "
            f"cutoff is not what failed; `{restoring[0]['label']}` restores the answer."
        )
    if not dropped:
        return (
            "The deployment already selected the needle in every CSA layer and no candidate restores the answer: "
            "the cause is outside the indexer's top-k."
        )
    if working:
        root = [f for f in working if _fix_kind(f, deployment_patch) == "removes the patch"]
        around = [f for f in working if _fix_kind(f, deployment_patch) == "patch stays in"]
        if root and around:
            return (
                f"Removing the patch (`{root[0]['label']}`) restores both selection and the answer: the patch "
                f"`{deployment_patch}` is the likely root cause. `{around[0]['label']}` also restores this case "
                "while the patch stays in: a workaround, not a fix. One case is evidence, not a verdict: "
                "`needlescope investigate` measures each suspect's causal effect over many paired cases."
            )
        return (
            f"First fix, in the order tried, that restores both selection and the answer on this case: "
            f"`{working[0]['label']}` ({_fix_kind(working[0], deployment_patch)}). One case is evidence, not a "
            "verdict: `needlescope investigate` measures each suspect's causal effect over many paired cases."
        )
    if selecting:
        return (
            f"`{selecting[0]['label']}` restores selection, but the answer is still wrong: the indexer is not the "
            "only cause."
        )
    return "No candidate restores selection for this case; widen the sweep (`needlescope indexer sweep`)."


def write_diagnosis(out: Path, **kw) -> Path:
    """Render and write ``out/DIAGNOSIS.md``; returns its path."""
    path = Path(out) / "DIAGNOSIS.md"
    path.write_text(render_diagnosis(**kw), encoding="utf-8")
    return path
