"""Write the outputs of a paired A/B comparison: compare.json, report.md, delta_heatmap.png, pairs.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from ..schema import check_schema
from .heatmap import length_depth_heatmap
from .probe import DIFFICULTY_SCHEMA, difficulty_lines

__all__ = [
    "COMPARE_SCHEMA",
    "GRADED_COMPARE_SCHEMA",
    "errors_line",
    "validate_compare",
    "write_compare_outputs",
]

_BUCKET_KEYS = (
    "length_lo",
    "length_hi",
    "n",
    "recall_a",
    "recall_b",
    "delta",
    "ci_low",
    "ci_high",
    "p_value",
    "p_holm",
)

_NUM_OR_NULL = {"type": ["number", "null"]}
# analysis.margins.paired_differences, plus the Holm-corrected p-value across buckets.
_PAIRED = {
    "type": "object",
    "required": [
        "n",
        "n_nonzero",
        "a_median",
        "b_median",
        "delta_mean",
        "delta_median",
        "w_plus",
        "p_value",
        "p_holm",
    ],
    "properties": {
        "n": {"type": "integer"},
        "n_nonzero": {"type": "integer"},
        **{
            k: _NUM_OR_NULL
            for k in ("a_median", "b_median", "delta_mean", "delta_median", "hl_shift", "hl_low", "hl_high")
        },
        **{k: {"type": "number"} for k in ("w_plus", "w_plus_mean", "p_value", "p_holm")},
    },
}
GRADED_COMPARE_SCHEMA: dict = {
    "type": ["object", "null"],
    "required": ["methods", "pairs", "buckets", "verdict"],
    "properties": {
        "methods": {"type": "array", "items": {"type": "string"}},
        "pairs": {"type": "integer"},
        "verdict": {"type": "string"},
        "buckets": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["length_lo", "length_hi", "n", "margin", "gold_logprob", "detectable_shift"],
                "properties": {
                    "length_lo": {"type": "integer"},
                    "length_hi": {"type": "integer"},
                    "n": {"type": "integer"},
                    "margin": _PAIRED,
                    "gold_logprob": _PAIRED,
                    "detectable_shift": _NUM_OR_NULL,
                },
            },
        },
    },
}

_SIDE_ERRORS = {
    "type": "object",
    "required": ["failed", "kinds"],
    "properties": {
        "failed": {"type": "integer"},
        "kinds": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
}

COMPARE_SCHEMA: dict = {
    "type": "object",
    "required": [
        "headline",
        "cases_matched",
        "recall_a",
        "recall_b",
        "errors",
        "buckets",
        "verdict",
        "regresses_from",
        "graded",
        "difficulty",
    ],
    "properties": {
        # The verdict with the recalls it compares (analysis.paired.headline): the console's line.
        "headline": {"type": "string"},
        "cases_matched": {"type": "integer"},
        "recall_a": {"type": "number"},
        "recall_b": {"type": "number"},
        # Cases of each side with no scored answer (run.compare.side_errors); never misses.
        "errors": {
            "type": "object",
            "required": ["cases", "a", "b"],
            "properties": {"cases": {"type": "integer"}, "a": _SIDE_ERRORS, "b": _SIDE_ERRORS},
        },
        "buckets": {
            "type": "array",
            "items": {
                "type": "object",
                "required": list(_BUCKET_KEYS),
                "properties": {
                    k: {"type": "integer" if k in ("length_lo", "length_hi", "n") else "number"}
                    for k in _BUCKET_KEYS
                },
            },
        },
        "verdict": {"type": "string"},
        "regresses_from": {"type": ["integer", "null"]},
        "graded": GRADED_COMPARE_SCHEMA,
        # The auto-difficulty search side A's run was made at (report.probe.DIFFICULTY_SCHEMA).
        "difficulty": {**DIFFICULTY_SCHEMA, "type": ["object", "null"]},
    },
}


def validate_compare(obj: dict) -> None:
    """Raise ValueError if ``obj`` does not follow COMPARE_SCHEMA."""
    check_schema(obj, COMPARE_SCHEMA, "compare")
    extra = set(obj) - set(COMPARE_SCHEMA["required"])
    if extra:
        raise ValueError(f"compare: unexpected keys {sorted(extra)}")


def errors_line(errors: dict) -> str | None:
    """One line saying what failed on each side (None when nothing did)."""
    parts = [
        f"{side}: {e['failed']} of {errors['cases']} requests failed ("
        + ", ".join(f"{kind} {n}" for kind, n in e["kinds"].items())
        + ")"
        for side, e in (("A", errors["a"]), ("B", errors["b"]))
        if e["failed"]
    ]
    return "; ".join(parts) or None


def _delta_heatmap(path: Path, cells: list[dict]) -> None:
    drawn = {(c["length"], c["depth"]): (c["delta"], f"{c['delta']:+.2f}\nn={c['n']}") for c in cells}
    length_depth_heatmap(path, drawn, cmap="RdBu", vmin=-1.0, vmax=1.0, label="recall B - recall A")


def _setting_line(prov: dict) -> str:
    info = prov.get("/get_server_info") if isinstance(prov.get("/get_server_info"), dict) else {}
    keys = ("model", "index_k", "index_q", "score_dtype", "index_topk", "patch")
    parts = [f"{k}={info[k]}" for k in keys if info.get(k) is not None]
    return ", ".join(parts) or prov.get("root", "?")


def _markdown(compare: dict, cells: list[dict], sides: dict, unpaired: int, alpha: float) -> str:
    lines = ["# needlescope compare: A vs B on identical prompts", ""]
    for name, side in sides.items():
        lines.append(f"- **{name}**: {side['run']} ({_setting_line(side['provenance'])})")
    lines += ["", f"**Verdict:** {compare['headline']}", ""]
    if not compare["headline"].endswith(compare["verdict"]):
        lines += [f"Test: {compare['verdict']}", ""]
    failed = errors_line(compare["errors"])
    if failed:
        lines += [f"**Failed requests:** {failed}; they are left out, not counted as misses.", ""]
    lines += [
        f"{compare['cases_matched']} cases scored on both sides; {unpaired} left out because a request "
        f"failed on A or B (errors are never misses). Significance level {alpha:g}; McNemar p-values "
        "are exact and two-sided, Holm-corrected across buckets; intervals are 95% paired bootstrap.",
        "",
        "| length | n | recall A | recall B | delta | 95% CI | p | p (Holm) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in compare["buckets"]:
        span = (
            str(b["length_lo"]) if b["length_lo"] == b["length_hi"] else f"{b['length_lo']}-{b['length_hi']}"
        )
        lines.append(
            f"| {span} | {b['n']} | {b['recall_a']:.2f} | {b['recall_b']:.2f} | {b['delta']:+.2f} "
            f"| [{b['ci_low']:+.2f}, {b['ci_high']:+.2f}] | {b['p_value']:.2g} | {b['p_holm']:.2g} |"
        )
    lines += [
        "",
        "## Per cell",
        "",
        "| length | depth | n | recall A | recall B | delta | 95% CI | p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['length']} | {c['depth']:g} | {c['n']} | {c['recall_a']:.2f} | {c['recall_b']:.2f} "
            f"| {c['delta']:+.2f} | [{c['ci_low']:+.2f}, {c['ci_high']:+.2f}] | {c['p_value']:.2g} |"
        )
    if compare["difficulty"] is not None:
        lines += [""] + difficulty_lines(compare["difficulty"])
    lines += [""] + _graded_lines(compare["graded"])
    lines += ["", "![delta heatmap](delta_heatmap.png)", ""]
    return "\n".join(lines)


def _p(paired: dict) -> str:
    return f"{paired['p_value']:.2g} | {paired['p_holm']:.2g}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3g}"


def _graded_lines(graded: dict | None) -> list[str]:
    """Margin and gold-logprob deltas per bucket, beside the recall table above."""
    lines = ["## Graded signal: margins (B - A, paired)", ""]
    if graded is None:
        return lines + [
            "Not measured: neither run holds graded scores on both sides (probe with --graded, on a "
            "server that returns prompt logprobs; docs/graded.md)."
        ]
    lines += [
        f"**Verdict:** {graded['verdict']}",
        "",
        f"{graded['pairs']} cases graded on both sides ({', '.join(graded['methods'])}). Margin: the "
        "answer's weakest gold token's logprob minus the best other token's (nats). Deltas are "
        "B - A per case; p: two-sided Wilcoxon signed-rank (exact up to 60 non-zero pairs), Holm "
        "across buckets; 'detectable' is the margin shift found with 80% power.",
        "",
        "| length | n | answer margin A (median) | B (median) | delta (median) | delta (mean) | p | p (Holm) "
        "| gold logprob delta (median) | p | p (Holm) | detectable |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in graded["buckets"]:
        m, g = b["margin"], b["gold_logprob"]
        span = (
            str(b["length_lo"]) if b["length_lo"] == b["length_hi"] else f"{b['length_lo']}-{b['length_hi']}"
        )
        shift = "-" if b["detectable_shift"] is None else f"{b['detectable_shift']:.3g}"
        lines.append(
            f"| {span} | {b['n']} | {_num(m['a_median'])} | {_num(m['b_median'])} | {_num(m['delta_median'])} "
            f"| {_num(m['delta_mean'])} | {_p(m)} | {_num(g['delta_median'])} | {_p(g)} | {shift} |"
        )
    return lines


def write_compare_outputs(
    out_dir: Path,
    result: dict,
    *,
    pairs: list[dict],
    unpaired: int,
    sides: dict,
    alpha: float,
) -> dict:
    """Write compare.json (exactly COMPARE_SCHEMA's keys), report.md, delta_heatmap.png and
    pairs.jsonl (one object per paired case: case_id, length, depth, a_correct, b_correct,
    a_answer, b_answer, expected, and with graded scores on both sides a_/b_ min_margin,
    gold_logprob, first_logprob, first_rank). Returns compare.json's body."""
    out_dir.mkdir(parents=True, exist_ok=True)
    compare = {k: result[k] for k in COMPARE_SCHEMA["required"]}
    validate_compare(compare)
    (out_dir / "compare.json").write_text(json.dumps(compare, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(compare, result["cells"], sides, unpaired, alpha))
    with (out_dir / "pairs.jsonl").open("w") as f:
        for row in pairs:
            f.write(json.dumps(row) + "\n")
    _delta_heatmap(out_dir / "delta_heatmap.png", result["cells"])
    return compare
