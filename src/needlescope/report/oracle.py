"""The logprob oracle's artifacts: ``export.json`` (one server's greedy logprobs over the prompt set)
and ``oracle.json`` + ``oracle.md`` (a server compared against an export). Both schemas are checked
before anything is written. ``oracle_lines`` is the short section other reports (``compare``'s
report.md) put beside their recall verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import BadInput
from ..paths import atomic_write_json, from_json_safe, json_safe
from ..schema import check_schema, record

__all__ = [
    "EXPORT_SCHEMA",
    "ORACLE_SCHEMA",
    "write_export",
    "write_oracle",
    "oracle_markdown",
    "oracle_lines",
    "read_oracle",
    "append_oracle_section",
]

_NUM_OR_NULL = {"type": ["number", "null"]}
# Every alternative's logprob a number: a hand-edited export with a string there was a traceback.
_TOP = {"type": "object", "additionalProperties": {"type": "number"}}
# A missing logprob is null; probability 0 is -9999.0 (run.oracle._json_lp).
_STEP = record({"token": {"type": "string"}, "logprob": _NUM_OR_NULL, "top": _TOP})

EXPORT_SCHEMA: dict = record(
    {
        "kind": {"type": "string"},
        "model": {"type": "string"},
        "base_url": {"type": "string"},
        "prompt_set": {"type": "string"},
        "prompt_set_sha256": {"type": "string"},
        "top_logprobs": {"type": "integer"},
        "prompt_ids_source": {"type": "string"},
        "server": {"type": "object"},
        "prompts": {
            "type": "array",
            "items": record(
                {
                    "id": {"type": "string"},
                    "category": {"type": "string"},
                    "prompt": {"type": "string"},
                    "max_tokens": {"type": "integer"},
                    "prompt_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
                    "prompt_tokens": {"type": ["array", "null"], "items": {"type": "string"}},
                    "text": {"type": "string"},
                    "finish_reason": {"type": ["string", "null"]},
                    "usage_prompt_tokens": {"type": ["integer", "null"]},
                    "steps": {"type": "array", "items": _STEP},
                }
            ),
        },
    }
)

_ROW_NUMBERS = (
    "top1_agreement",
    "topk_overlap",
    "mean_abs_dlogprob",
    "max_abs_dlogprob",
    "mean_kl",
    "max_kl",
    "divergence_margin",
)

_SAFE_NUMBERS = frozenset(_ROW_NUMBERS) | {"mean_abs_dlogprob", "max_abs_dlogprob", "mean_kl", "max_kl"}
"""The numbers of oracle.json that may be non-finite (written as strings, ``paths.json_safe``)."""

ORACLE_SCHEMA: dict = record(
    {
        "kind": {"type": "string"},
        "reference": {"type": "object"},
        "candidate": {"type": "object"},
        "flip_margin": {"type": "number"},
        "atol": {"type": "number"},
        "summary": record(
            {
                "prompts": {"type": "integer"},
                "prompt_ids_equal": {"type": "integer"},
                "diverged": {"type": "integer"},
                "verdict": {"type": "string"},
                "top1_agreement": _NUM_OR_NULL,
            }
        ),
        "prompts": {
            "type": "array",
            "items": record(
                {
                    "id": {"type": "string"},
                    "category": {"type": "string"},
                    "prompt_ids_equal": {"type": ["boolean", "null"]},
                    "first_prompt_difference": {"type": ["integer", "null"]},
                    "compared": {"type": "integer"},
                    "first_divergence": {"type": ["integer", "null"]},
                    "low_margin_positions": {"type": "array", "items": {"type": "integer"}},
                    "verdict": {"type": "string"},
                    "ref_text": {"type": "string"},
                    "cand_text": {"type": "string"},
                    **{k: _NUM_OR_NULL for k in _ROW_NUMBERS},
                }
            ),
        },
    }
)


def write_export(obj: dict, out: Path, name: str = "export.json") -> Path:
    """Check ``obj`` against EXPORT_SCHEMA and write it to ``out/name``."""
    check_schema(obj, EXPORT_SCHEMA, "export")
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, obj)
    return path


def read_oracle(path: str | Path) -> dict:
    """An ``oracle.json`` read back and checked (for reports that put it beside theirs);
    BadInput when it is missing or not one."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        # written by json_safe: an unbounded |Δ| or KL (one side's probability 0) is "inf"
        for row in [obj.get("summary"), *(obj.get("prompts") or [])]:
            if isinstance(row, dict):
                row.update({k: from_json_safe(v) for k, v in row.items() if k in _SAFE_NUMBERS})
        check_schema(obj, ORACLE_SCHEMA, "oracle")
    except (OSError, ValueError) as e:
        raise BadInput(
            f"{path} is not a readable oracle.json ({e}); give the oracle.json of `needlescope oracle compare`"
        ) from None
    return obj


def append_oracle_section(report_md: str | Path, result: dict) -> None:
    """Append ``oracle_lines(result)`` to an existing markdown report (compare's report.md)."""
    with Path(report_md).open("a", encoding="utf-8") as f:
        f.write("\n" + "\n".join(oracle_lines(result)))


def _f(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def oracle_lines(result: dict) -> list[str]:
    """A short markdown section: the oracle verdict and its numbers, for any report."""
    s = result["summary"]
    return [
        "## Logprob oracle",
        "",
        f"Verdict: **{s['verdict']}** ({result['candidate']['base_url']} against the export of "
        f"{result['reference']['base_url']}, {s['prompts']} prompts, {s['positions_compared']} positions).",
        "",
        f"- prompt ids equal: {s['prompt_ids_equal']} of {s['prompts']}"
        + (f" ({s['prompt_ids_unchecked']} unchecked)" if s["prompt_ids_unchecked"] else ""),
        f"- generations: {s['identical']} identical, {s['close']} same tokens with |Δ logprob| > "
        f"{result['atol']:g}, {s['flips_at_low_margin']} flipped at a low-margin position "
        f"(< {result['flip_margin']:g} nats), {s['diverged']} diverged where the reference was confident",
        f"- top-1 agreement {_f(s['top1_agreement'], '.4f')}, top-k overlap {_f(s['topk_overlap'], '.4f')}, "
        f"mean |Δ logprob| {_f(s['mean_abs_dlogprob'])} (max {_f(s['max_abs_dlogprob'])}), "
        f"KL on the common support mean {_f(s['mean_kl'])} (max {_f(s['max_kl'])})",
        f"- reference positions with a margin below {result['flip_margin']:g} nats (a flip expected from "
        f"noise): {s['low_margin_positions']}",
        "",
    ]


def oracle_markdown(result: dict) -> str:
    """oracle.md: the summary section and a table per prompt."""
    lines = ["# Logprob oracle", "", *oracle_lines(result)[2:]]
    lines += [
        "| prompt | category | prompt ids | compared | first divergence | margin there | top-1 | top-k overlap "
        "| mean abs Δ | max KL | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["prompts"]:
        ids = {True: "equal", False: f"differ at {p['first_prompt_difference']}", None: "unchecked"}[
            p["prompt_ids_equal"]
        ]
        div = "-" if p["first_divergence"] is None else str(p["first_divergence"])
        lines.append(
            f"| {p['id']} | {p['category']} | {ids} | {p['compared']} | {div} | {_f(p['divergence_margin'])} "
            f"| {_f(p['top1_agreement'], '.3f')} | {_f(p['topk_overlap'], '.3f')} "
            f"| {_f(p['mean_abs_dlogprob'])} | {_f(p['max_kl'])} | {p['verdict']} |"
        )
    diverged = [p for p in result["prompts"] if p["first_divergence"] is not None]
    if diverged:
        lines += ["", "## Where the generations part", ""]
        for p in diverged:
            lines.append(
                f"- `{p['id']}` at token {p['first_divergence']}: reference {p['ref_text']!r}, "
                f"candidate {p['cand_text']!r}"
            )
    return "\n".join(lines) + "\n"


def write_oracle(result: dict, out: Path) -> tuple[Path, Path]:
    """Check ``result`` against ORACLE_SCHEMA, write ``oracle.json`` and ``oracle.md`` under ``out``."""
    check_schema(result, ORACLE_SCHEMA, "oracle")
    js = Path(out) / "oracle.json"
    js.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(js, json_safe(result))
    md = Path(out) / "oracle.md"
    md.write_text(oracle_markdown(result), encoding="utf-8")
    return js, md
