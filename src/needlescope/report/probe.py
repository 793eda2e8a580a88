"""Write the outputs of a probe run: summary.json, report.md, heatmap.png and results.jsonl.

Renders only: the curve, the depth profile and the length disagreements are decided in
``analysis.probe_summary`` (``analyze_probe``), whose summary this writes with its headline.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..analysis.curve import Cell, pooled_recall
from ..analysis.probe_summary import CELL_KEYS
from ..schema import check_schema, record
from .breakdown import ENDPOINTS_SCHEMA, FAILURES_SCHEMA, endpoint_lines, failure_lines
from .heatmap import length_depth_heatmap

__all__ = [
    "DIFFICULTY_SCHEMA",
    "GRADED_SCHEMA",
    "difficulty_lines",
    "SUMMARY_SCHEMA",
    "DEPTH_PROFILE_SCHEMA",
    "depth_lines",
    "graded_lines",
    "headline",
    "validate_summary",
    "write_probe_outputs",
]

_NUM_OR_NULL = {"type": ["number", "null"]}
# analysis.margins.margin_summary's keys: counts are integers, the rest numbers (null: no data).
_MARGIN_COUNTS = ("n", "first_rank1", "margin_tokens", "below_threshold", "lost")
_MARGIN_VALUES = (
    "first_logprob_mean",
    "gold_logprob_mean",
    "gold_logprob_median",
    "margin_mean",
    "margin_p10",
    "margin_p50",
    "margin_p90",
    "margin_min",
    "answer_margin_median",
)


def _margin_rows(*keys: str) -> dict:
    props = {k: {"type": "integer"} for k in _MARGIN_COUNTS} | {k: _NUM_OR_NULL for k in _MARGIN_VALUES}
    props |= {"length": {"type": "integer"}, "depth": {"type": "number"}}
    return {
        "type": "array",
        "items": {
            "type": "object",
            "required": [*keys, *_MARGIN_COUNTS, *_MARGIN_VALUES],
            "properties": props,
        },
    }


_LEVEL = {
    "type": "object",
    "required": ["distractors", "value_digits"],
    "properties": {
        "distractors": {"type": "integer"},
        "value_digits": {"type": "integer"},
        "recall": {"type": ["number", "null"]},
        "n": {"type": "integer"},
        "run": {"type": "string"},
    },
}
# run.difficulty's record of an auto-difficulty search.
DIFFICULTY_SCHEMA: dict = {
    "type": "object",
    "required": ["target", "order", "levels", "chosen", "reached"],
    "properties": {
        "target": {"type": "number"},
        "order": {"type": "string"},
        "levels": {"type": "array", "items": _LEVEL},
        "chosen": _LEVEL,
        "reached": {"type": "boolean"},
    },
}

GRADED_SCHEMA: dict = {
    "type": "object",
    "required": [
        "method",
        "note",
        "top_logprobs",
        "margin_threshold",
        "scored",
        "errors",
        "cells",
        "lengths",
    ],
    "properties": {
        "method": {"type": ["string", "null"]},
        "tokenize": {"type": ["string", "null"]},
        "note": {"type": "string"},
        "top_logprobs": {"type": "integer"},
        "margin_threshold": {"type": "number"},
        "scored": {"type": "integer"},
        "errors": {"type": "integer"},
        "cells": _margin_rows("length", "depth"),
        "lengths": _margin_rows("length"),
    },
}


def _tests(group_type: str) -> dict:
    props = {"group": {"type": group_type}, "n": {"type": "integer"}, "correct": {"type": "integer"}}
    props |= {"recall": _NUM_OR_NULL, "rest_recall": _NUM_OR_NULL}
    props |= {"p_value": {"type": "number"}, "p_holm": {"type": "number"}, "worse": {"type": "boolean"}}
    return {"type": "array", "items": record(props)}


_NUMBER = {"type": "number"}
_COUNT = {"type": "integer"}
_HOLE = record(
    {
        "middle_depths": {"type": "array", "items": _NUMBER},
        "end_depths": {"type": "array", "items": _NUMBER},
        "middle_n": _COUNT,
        "middle_correct": _COUNT,
        "middle_recall": _NUMBER,
        "end_n": _COUNT,
        "end_correct": _COUNT,
        "end_recall": _NUMBER,
        "p_value": _NUMBER,
        "found": {"type": "boolean"},
    }
)
_DEPTH = record(
    {
        "depth": _NUMBER,
        "n": _COUNT,
        "correct": _COUNT,
        "recall": _NUMBER,
        "ci_low": _NUMBER,
        "ci_high": _NUMBER,
    }
)
# analysis.depth.depth_profile: recall by depth pooled over lengths and the depth patterns;
# ``pattern`` is "lost_in_the_middle", "depth_not_length" or null.
DEPTH_PROFILE_SCHEMA: dict = record(
    {
        "alpha": _NUMBER,
        "depths": {"type": "array", "items": _DEPTH},
        "middle_hole": {**_HOLE, "type": ["object", "null"]},
        "depth_tests": _tests("number"),
        "length_tests": _tests("integer"),
        "pattern": {"type": ["string", "null"]},
    }
)

SUMMARY_SCHEMA: dict = {
    "type": "object",
    "required": [
        "headline",
        "effective_length",
        "threshold",
        "kind",
        "model",
        "cells",
        "cliff",
        "depth_profile",
        "provenance",
    ],
    "properties": {
        "headline": {"type": "array", "items": {"type": "string"}},
        "effective_length": {"type": ["integer", "null"]},
        "threshold": {"type": "number"},
        "kind": {"type": "string"},
        "model": {"type": "string"},
        "cells": {
            "type": "array",
            "items": {
                "type": "object",
                "required": list(CELL_KEYS),
                "properties": {
                    "length": {"type": "integer"},
                    "depth": {"type": "number"},
                    "n": {"type": "integer"},
                    "correct": {"type": "integer"},
                    "errors": {"type": "integer"},
                    "recall": {"type": ["number", "null"]},
                    "ci_low": {"type": "number"},
                    "ci_high": {"type": "number"},
                },
            },
        },
        "cliff": {
            "type": ["object", "null"],
            "required": ["from", "to", "drop"],
            "properties": {
                "from": {"type": "integer"},
                "to": {"type": "integer"},
                "drop": {"type": "number"},
            },
        },
        "depth_profile": DEPTH_PROFILE_SCHEMA,
        "provenance": {"type": "object"},
        "errors_total": {"type": "integer"},
        "error_reasons": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["kind", "count", "example"],
                "properties": {
                    "kind": {"type": "string"},
                    "count": {"type": "integer"},
                    "example": {"type": "string"},
                },
            },
        },
        "cells_without_data": {"type": "integer"},
        "length_mismatches": {"type": "integer"},
        "unreachable_lengths": {"type": "integer"},
        "server_length_mismatches": {"type": "integer"},
        "value_digits": {"type": "integer"},
        "value_digits_source": {"type": "string"},
        "failures": FAILURES_SCHEMA,
        "endpoints": ENDPOINTS_SCHEMA,
        "graded": GRADED_SCHEMA,
        "difficulty": DIFFICULTY_SCHEMA,
    },
}


def validate_summary(obj: dict) -> None:
    """Raise ValueError if ``obj`` does not follow SUMMARY_SCHEMA (a minimal JSON Schema checker)."""
    check_schema(obj, SUMMARY_SCHEMA, "summary")


def _heatmap(path: Path, cells: list[Cell]) -> None:
    drawn = {}
    for c in cells:
        text = f"{c.recall:.2f}\nn={c.n}" if c.recall is not None else "no data"
        drawn[(c.length, c.depth)] = (
            c.recall if c.n else None,
            text + (f"\nerr={c.errors}" if c.errors else ""),
        )
    length_depth_heatmap(path, drawn, cmap="RdYlGn", vmin=0.0, vmax=1.0, label="recall")


def _pct(depths) -> str:
    return ", ".join(f"{d:g}%" for d in depths)


def _length_lines(summary: dict) -> list[str]:
    eff, c = summary["effective_length"], summary["cliff"]
    if all(cell["recall"] is None for cell in summary["cells"]):
        # Nothing measured is not a failure at the shortest length: say what happened instead.
        return [
            f"no case was scored: every request failed or missed its length ({summary['errors_total']} "
            "failed); recall, the effective length and the cliff are unknown"
        ]
    lines = [
        f"effective length: {eff} tokens (pooled recall >= {summary['threshold']:g} at it and every shorter length)"
        if eff is not None
        else f"effective length: none (pooled recall is below {summary['threshold']:g} at the shortest tested length)"
    ]
    if c:
        lines.append(f"cliff: {c['from']} -> {c['to']} tokens, pooled recall drops by {c['drop']:.2f}")
    return lines


def _seconds(x: float) -> str:
    return f"{x * 1000:.0f} ms" if abs(x) < 1 else f"{x:.1f} s"


def _cross_case_line(failures: dict) -> str | None:
    x = failures.get("cross_case")
    if not x or not x["significant"]:
        return None
    lag = x["sent_before_s_median"]
    when = "" if lag is None else f"; their source case was sent a median {_seconds(lag)} before"
    return (
        f"answers from other requests: possible cache or state reuse ({x['count']} of {failures['misses']} "
        f"misses give another case's expected value, never stated in their prompt; {x['same_connection']} over "
        f"the same connection as their source, {x['other_connection']} over another, {x['connection_unknown']} "
        f"unknown{when}; chance would explain about {x['chance'] * x['wrong_values']:.2g}, p = {x['p_value']:.2g}); "
        "any length or depth pattern below may only follow the order the requests were sent in"
    )


def headline(summary: dict) -> list[str]:
    """The probe's findings, one line each, most specific first: answers that belong to other
    requests, a middle-depth hole, failures that follow depth and not length; then the length
    curve (effective length and cliff), unless depth and not length explains the failures."""
    lines = []
    cross = _cross_case_line(summary.get("failures") or {})
    if cross:
        lines.append(cross)
    prof = summary["depth_profile"]
    if prof["pattern"] == "depth_not_length":
        worse = [t for t in prof["depth_tests"] if t["worse"]]
        where = "; ".join(
            f"{t['recall']:.2f} at depth {t['group']:g}% vs {t['rest_recall']:.2f} elsewhere (Holm p = {t['p_holm']:.2g})"
            for t in worse
        )
        lines.append(
            f"failures depend on depth, not on length: pooled recall {where}, and no length is worse than "
            "the rest, so an effective length does not describe this target"
        )
    hole = prof["middle_hole"]
    if hole and hole["found"]:
        lines.append(
            f"lost in the middle: pooled recall {hole['middle_recall']:.2f} at the middle depths "
            f"({_pct(hole['middle_depths'])}) vs {hole['end_recall']:.2f} at the ends "
            f"({_pct(hole['end_depths'])}), Fisher exact p = {hole['p_value']:.2g}"
        )
    if prof["pattern"] == "depth_not_length":
        return lines
    return lines + _length_lines(summary)


def depth_lines(profile: dict) -> list[str]:
    """The report's depth section: recall by depth pooled over lengths, and the depth tests."""
    tested = {t["group"]: t for t in profile["depth_tests"]}
    lines = [
        "| depth | pooled recall | 95% CI | n | vs the other depths (Holm p) |",
        "|---|---|---|---|---|",
    ]
    for d in profile["depths"]:
        t = tested.get(d["depth"])
        versus = "-" if t is None else f"{t['p_holm']:.2g}" + (" **worse**" if t["worse"] else "")
        lines.append(
            f"| {d['depth']:g}% | {d['recall']:.3f} | [{d['ci_low']:.3f}, {d['ci_high']:.3f}] | {d['n']} | {versus} |"
        )
    hole = profile["middle_hole"]
    lines.append("")
    if hole is None:
        lines.append("Middle-depth test: needs at least three depths with data.")
    else:
        verdict = "**lost in the middle**" if hole["found"] else "no middle-depth hole"
        lines.append(
            f"Middle depths ({_pct(hole['middle_depths'])}) {hole['middle_correct']}/{hole['middle_n']} vs ends "
            f"({_pct(hole['end_depths'])}) {hole['end_correct']}/{hole['end_n']}: Fisher exact p = "
            f"{hole['p_value']:.2g}, {verdict} at alpha {profile['alpha']:g}."
        )
    worse = [str(t["group"]) for t in profile["length_tests"] if t["worse"]]
    lines.append(
        "Lengths worse than the rest (pooled over depths, Holm p < "
        f"{profile['alpha']:g}): {', '.join(worse) if worse else 'none'}."
    )
    return lines


def _markdown(summary: dict, cells: list[Cell], notes: list[str]) -> str:
    lines = [f"# needlescope probe: {summary['model']} ({summary['kind']})", ""]
    lines += ["## Headline", ""] + [f"- {h}" for h in summary["headline"]] + [""]
    if summary["depth_profile"]["pattern"] == "depth_not_length":
        # The headline leaves the length curve out here; every other headline states it once.
        eff, c = summary["effective_length"], summary["cliff"]
        lines.append(
            f"**Effective length** (pooled recall >= {summary['threshold']:g} at it and every shorter length): "
            + (f"{eff} tokens" if eff is not None else "none")
            + "; the failures follow depth, not length (see the headline)"
        )
        lines.append(
            "**Cliff:** "
            + (f"{c['from']} -> {c['to']} tokens, recall drops by {c['drop']:.2f}" if c else "none")
        )
    lines.append(
        f"**Errors:** {summary['errors_total']} request(s) failed; they are excluded from recall, not counted as misses."
    )
    # Why they failed, not only how many: the console sends the user here ("see report.md").
    lines += [f"- {e['count']} {e['kind']}: {e['example']}" for e in summary.get("error_reasons", [])]
    lines.append(
        f"**Needle values:** {summary['value_digits']} digits, from {summary['value_digits_source']}."
    )
    if summary["cells_without_data"]:
        lines += [
            "",
            f"> **WARNING: {summary['cells_without_data']} cell(s) have no scored case** (every request failed "
            "or missed its length): their recall is null, drawn as 'no data', and they are left out of the "
            "effective length and the cliff.",
        ]
    if summary["length_mismatches"]:
        lines += [
            "",
            f"> **WARNING: {summary['length_mismatches']} case(s) have a length disagreement**: "
            f"{summary['unreachable_lengths']} did not reach their target length (left out of the analysis), "
            f"{summary['server_length_mismatches']} were counted differently by the server "
            "(usage.prompt_tokens). Each is named under Notes.",
        ]
    lines += [
        "",
        "| length | depth | recall | 95% CI | n | correct | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        recall = "no data" if cell.recall is None else f"{cell.recall:.3f}"
        lines.append(
            f"| {cell.length} | {cell.depth:g} | {recall} | [{cell.ci_low:.3f}, {cell.ci_high:.3f}] "
            f"| {cell.n} | {cell.correct} | {cell.errors} |"
        )
    lines += ["", "## Recall by length and by depth", "", "| length | pooled recall | n |", "|---|---|---|"]
    for length, (k, n) in pooled_recall(cells).items():
        lines.append(f"| {length} | {f'{k / n:.3f}' if n else 'no data'} | {n} |")
    lines += [""] + depth_lines(summary["depth_profile"])
    if "difficulty" in summary:
        lines += [""] + difficulty_lines(summary["difficulty"])
    if "graded" in summary:
        lines += [""] + graded_lines(summary["graded"], pooled_recall(cells))
    if "failures" in summary:
        lines += [""] + failure_lines(summary["failures"])
    if "endpoints" in summary:
        lines += [""] + endpoint_lines(summary["endpoints"])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += [
        "",
        "## Provenance",
        "",
        "```json",
        json.dumps(summary["provenance"], indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(lines)


def _nats(value: float | None, sign: bool = False) -> str:
    return "-" if value is None else (f"{value:+.3g}" if sign else f"{value:.3g}")


def difficulty_lines(difficulty: dict) -> list[str]:
    """The report's auto-difficulty section: each level tried on the reference, and the choice."""
    c = difficulty["chosen"]
    verdict = (
        f"below the target {difficulty['target']:g} at"
        if difficulty["reached"]
        else f"never below the target {difficulty['target']:g}; the hardest level is held:"
    )
    lines = [
        "## Auto-difficulty",
        "",
        f"Reference recall {verdict} distractors {c['distractors']}, values of {c['value_digits']} digits. "
        f"Order of escalation: {difficulty['order']}.",
        "",
        "| level | distractors | value digits | reference recall | n |",
        "|---|---|---|---|---|",
    ]
    for i, lv in enumerate(difficulty["levels"]):
        recall = "no data" if lv["recall"] is None else f"{lv['recall']:.3f}"
        lines.append(f"| {i} | {lv['distractors']} | {lv['value_digits']} | {recall} | {lv['n']} |")
    return lines


def graded_lines(graded: dict, pooled: dict[int, tuple[int, int]]) -> list[str]:
    """The report's graded-signal section: per length, beside pooled recall."""
    lines = ["## Graded signal (teacher-forced gold answer)", "", graded["note"] + "."]
    if graded["method"] is None:
        return lines
    t = graded["margin_threshold"]
    lines += [
        "",
        f"{graded['scored']} answers scored, {graded['errors']} scoring request(s) failed. Margin: the "
        "gold token's logprob minus the best other token's, in nats, at every answer token; an "
        f"answer's margin is its weakest token's. 'thin' counts answers won by less than {t:g} nats "
        "(lost ones included); 'lost' those a greedy decode would not give.",
        "",
        "| length | recall | n | first-token logprob | gold logprob | token margin p10 / p50 / p90 "
        "| min margin | thin | lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in graded["lengths"]:
        k, n = pooled.get(g["length"], (0, 0))
        recall = f"{k / n:.3f}" if n else "no data"
        spread = " / ".join(_nats(g[q], True) for q in ("margin_p10", "margin_p50", "margin_p90"))
        lines.append(
            f"| {g['length']} | {recall} | {g['n']} | {_nats(g['first_logprob_mean'])} "
            f"| {_nats(g['gold_logprob_mean'])} | {spread} | {_nats(g['margin_min'], True)} "
            f"| {g['below_threshold']} | {g['lost']} |"
        )
    return lines


def write_probe_outputs(
    out_dir: Path, analysis: dict, *, cells: list[Cell], results: list[dict], notes: list[str]
) -> dict:
    """Write the four probe outputs into ``out_dir`` from ``analysis`` (``analysis.probe_summary.
    analyze_probe`` over ``cells`` and ``results``) and return the summary: the analysis with its
    headline first, checked against ``SUMMARY_SCHEMA``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = sorted(cells, key=lambda c: (c.length, c.depth))
    summary = {"headline": headline(analysis), **analysis}
    validate_summary(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(summary, cells, notes))
    with (out_dir / "results.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(r, default=str) + "\n")
    _heatmap(out_dir / "heatmap.png", cells)
    return summary
