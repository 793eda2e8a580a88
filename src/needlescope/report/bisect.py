"""Write the outputs of a collapse bisection: bisect.json, bisect.md and results.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from ..schema import check_schema

__all__ = ["BISECT_SCHEMA", "validate_bisect", "write_bisect_outputs", "residue_lines", "step_line"]

_INT_OR_NULL = {"type": ["integer", "null"]}
_END = {
    "type": "object",
    "required": ["length", "correct", "n", "recall", "ci_low", "ci_high"],
    "properties": {
        "length": {"type": "integer"},
        "correct": {"type": "integer"},
        "n": {"type": "integer"},
        "recall": {"type": ["number", "null"]},
        "ci_low": {"type": "number"},
        "ci_high": {"type": "number"},
    },
}
"""One end of a bracket: its counts, recall and Wilson 95% interval."""

BISECT_SCHEMA: dict = {
    "type": "object",
    "required": [
        "lo",
        "hi",
        "resolution",
        "threshold",
        "cases_per_point",
        "bracketed",
        "confirmed",
        "crossing",
        "steps",
        "last_pass",
        "collapse_length",
        "message",
        "boundaries",
        "boundaries_source",
        "residue",
        "points",
        "requests_used",
        "full_grid_requests",
        "request_ratio",
        "errors",
        "provenance",
    ],
    "properties": {
        "lo": {"type": "integer"},
        "hi": {"type": "integer"},
        "resolution": {"type": "integer"},
        "threshold": {"type": "number"},
        "cases_per_point": {"type": "integer"},
        "bracketed": {"type": "boolean"},
        "last_pass": _INT_OR_NULL,
        "collapse_length": _INT_OR_NULL,
        "message": {"type": "string"},
        "boundaries": {"type": "array", "items": {"type": "integer"}},
        "boundaries_source": {"type": "string"},
        "confirmed": {"type": "boolean"},
        "crossing": {
            "type": ["object", "null"],
            "required": ["last_pass", "first_fail", "confidence", "meaning"],
            "properties": {
                "last_pass": _END,
                "first_fail": _END,
                "confidence": {"type": "number"},
                "meaning": {"type": "string"},
            },
        },
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["phase", "tested", "last_pass", "first_fail", "p_value", "narrowed"],
                "properties": {
                    "phase": {"type": "string"},
                    "tested": _INT_OR_NULL,
                    "last_pass": _END,
                    "first_fail": _END,
                    "p_value": {"type": "number"},
                    "narrowed": {"type": "boolean"},
                },
            },
        },
        "residue": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["modulus", "strata", "p_value", "classes", "flagged"],
                "properties": {
                    "modulus": {"type": "integer"},
                    "strata": {"type": "integer"},
                    "p_value": {"type": "number"},
                    "classes": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["residue", "n", "correct", "recall", "rest_recall", "p", "p_holm"],
                            "properties": {
                                "residue": {"type": "integer"},
                                "n": {"type": "integer"},
                                "correct": {"type": "integer"},
                                "recall": {"type": ["number", "null"]},
                                "rest_recall": {"type": ["number", "null"]},
                                "p": {"type": "number"},
                                "p_holm": {"type": "number"},
                            },
                        },
                    },
                    "flagged": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["length", "phase", "n", "correct", "recall", "ci_low", "ci_high"],
                "properties": {
                    "length": {"type": "integer"},
                    "phase": {"type": "string"},
                    "n": {"type": "integer"},
                    "correct": {"type": "integer"},
                    "recall": {"type": ["number", "null"]},
                    "ci_low": {"type": "number"},
                    "ci_high": {"type": "number"},
                },
            },
        },
        "requests_used": {"type": "integer"},
        "full_grid_requests": {"type": "integer"},
        "request_ratio": {"type": "number"},
        "errors": {"type": "integer"},
        "provenance": {"type": "object"},
    },
}


def validate_bisect(obj: dict) -> None:
    """Raise ValueError if ``obj`` does not follow BISECT_SCHEMA."""
    check_schema(obj, BISECT_SCHEMA, "bisect")


def residue_lines(residue: list[dict]) -> list[str]:
    """One sentence per residue test, naming any failing class."""
    out = []
    for r in residue:
        head = (
            f"mod {r['modulus']}: {r['strata']} runs of consecutive lengths, each class against the rest of its "
            f"runs (exact, stratified), smallest Holm p={r['p_value']:.2g}"
        )
        bad = [c for c in r["classes"] if c["residue"] in r["flagged"]]
        if bad:
            parts = ", ".join(
                f"length = {c['residue']} (mod {r['modulus']}) recalls {c['recall']:.2f} against "
                f"{c['rest_recall']:.2f} (n={c['n']}, Holm p={c['p_holm']:.2g})"
                for c in bad
            )
            out.append(f"{head}; residue-class failure: {parts}")
        else:
            out.append(f"{head}; no residue class differs from the rest")
    return out


def _end(e: dict) -> str:
    return f"{e['length']}: {e['correct']}/{e['n']} [{e['ci_low']:.2f}, {e['ci_high']:.2f}]"


def step_line(step: dict) -> str:
    """One step's evidence: the bracket it proposes, both ends' counts and intervals, p, outcome."""
    what = "coarse bracket" if step["tested"] is None else f"tested {step['tested']}"
    done = "narrowed" if step["narrowed"] else "not narrowed (ends do not differ significantly)"
    return (
        f"{step['phase']}: {what}; pass end {_end(step['last_pass'])}, fail end {_end(step['first_fail'])}; "
        f"Fisher p={step['p_value']:.2g}; {done}"
    )


def _markdown(s: dict) -> str:
    lines = [
        "# needlescope probe --bisect",
        "",
        f"**Result:** {s['message']}.",
        f"**Range** [{s['lo']}, {s['hi']}] tokens, threshold {s['threshold']:g}, resolution {s['resolution']} tokens, "
        f"{s['cases_per_point']} cases per length to start.",
        f"**Requests:** {s['requests_used']} against {s['full_grid_requests']} for a full grid of the same "
        f"resolution ({100 * s['request_ratio']:.1f}%); {s['errors']} failed and are not counted as misses.",
        f"**Kernel boundaries** ({s['boundaries_source']}): {', '.join(map(str, s['boundaries'])) or 'none'}.",
        "",
    ]
    if s["steps"]:
        lines += ["## Steps (evidence behind each)", ""] + [f"- {step_line(x)}" for x in s["steps"]] + [""]
    if s["residue"]:
        lines += ["## Residue classes", ""] + [f"- {x}" for x in residue_lines(s["residue"])] + [""]
    lines += ["## Lengths tested", "", "| length | phase | recall | 95% CI | n |", "|---|---|---|---|---|"]
    for p in s["points"]:
        rec = "-" if p["recall"] is None else f"{p['recall']:.2f}"
        lines.append(
            f"| {p['length']} | {p['phase']} | {rec} | [{p['ci_low']:.2f}, {p['ci_high']:.2f}] | {p['n']} |"
        )
    return "\n".join(lines) + "\n"


def write_bisect_outputs(out_dir: Path, summary: dict, results: list[dict]) -> dict:
    """Write bisect.json (BISECT_SCHEMA), bisect.md and results.jsonl; return the summary."""
    validate_bisect(summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bisect.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "bisect.md").write_text(_markdown(summary))
    with (out_dir / "results.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(r, default=str) + "\n")
    return summary
