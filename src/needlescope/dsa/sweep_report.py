"""``sweep.json``: its schema, its check and its Markdown rendering (``needlescope.dsa.sweep`` builds it).

The schema is documented in docs/dsa_rankdump.md ("sweep.json schema"); ``needlescope.dsa.sweep``
explains every field's meaning.
"""

from __future__ import annotations

from needlescope.schema import check_schema

__all__ = [
    "SWEEP_SCHEMA",
    "validate_sweep",
    "render_sweep_md",
    "fmt_setting",
    "patch_lines",
    "workaround_lines",
]

_NUM_OR_NULL = {"type": ["number", "null"]}
_INT_OR_NULL = {"type": ["integer", "null"]}
_SETTING_PROPS = {
    "index_k": {"type": "string"},
    "index_q": {"type": "string"},
    "index_topk": {"type": "integer"},
}
SWEEP_SCHEMA: dict = {
    "type": "object",
    "required": [
        "model",
        "kind",
        "lengths",
        "target_length",
        "target_rate",
        "generate",
        "settings",
        "cells",
        "runs",
        "cheapest",
        "workarounds",
        "baseline",
        "verdict",
    ],
    "properties": {
        "model": {"type": "string"},
        "kind": {"type": "string"},
        "lengths": {"type": "array", "items": {"type": "integer"}},
        "depths": {"type": "array", "items": {"type": "number"}},
        "trials": {"type": "integer"},
        "seed": {"type": "integer"},
        "value_digits": {"type": "integer"},
        "score_dtype": {"type": "string"},
        "target_length": {"type": "integer"},
        "target_rate": {"type": "number"},
        "generate": {"type": "boolean"},
        "patch": {"type": ["string", "null"]},
        "settings": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [*_SETTING_PROPS, "cost_rank", "restored_to", "rate_at_target"],
                "properties": {
                    **_SETTING_PROPS,
                    "cost_rank": {"type": "integer"},
                    "restored_to": _INT_OR_NULL,
                    "rate_at_target": _NUM_OR_NULL,
                },
            },
        },
        "cells": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    *_SETTING_PROPS,
                    "length",
                    "cases",
                    "scored",
                    "unscored",
                    "selected",
                    "selection_rate",
                    "answers_correct",
                    "answer_recall",
                    "per_layer",
                ],
                "properties": {
                    **_SETTING_PROPS,
                    "length": {"type": "integer"},
                    "cases": {"type": "integer"},
                    "scored": {"type": "integer"},
                    "unscored": {"type": "integer"},
                    "selected": {"type": "integer"},
                    "selection_rate": _NUM_OR_NULL,
                    "answers_correct": _INT_OR_NULL,
                    "answer_recall": _NUM_OR_NULL,
                    "per_layer": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["layer", "n", "selected", "rate"],
                            "properties": {
                                "layer": {"type": "integer"},
                                "n": {"type": "integer"},
                                "selected": {"type": "integer"},
                                "rate": _NUM_OR_NULL,
                                "median_best_rank": _NUM_OR_NULL,
                                "mean_margin_frac": _NUM_OR_NULL,
                            },
                        },
                    },
                },
            },
        },
        "runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["case_id", "length", *_SETTING_PROPS, "selected", "layers", "answer_correct"],
                "properties": {
                    "case_id": {"type": "string"},
                    "length": {"type": "integer"},
                    "depth": {"type": "number"},
                    "trial": {"type": "integer"},
                    "prompt_tokens": {"type": "integer"},
                    **_SETTING_PROPS,
                    "selected": {"type": ["boolean", "null"]},
                    "layers": {"type": "array"},
                    "answer": {"type": ["string", "null"]},
                    "answer_correct": {"type": ["boolean", "null"]},
                },
            },
        },
        "cheapest": {
            "type": ["object", "null"],
            "required": [*_SETTING_PROPS, "rate"],
            "properties": {**_SETTING_PROPS, "rate": {"type": "number"}},
        },
        # Settings restoring the target only by reading every entry (dsa.sweep.reads_everything).
        "workarounds": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [*_SETTING_PROPS, "rate", "k_used"],
                "properties": {**_SETTING_PROPS, "rate": {"type": "number"}, "k_used": {"type": "integer"}},
            },
        },
        "baseline": {"type": "object", "required": list(_SETTING_PROPS), "properties": _SETTING_PROPS},
        "verdict": {"type": "array", "items": {"type": "string"}},
    },
}
"""JSON-Schema-style description of ``sweep.json`` (checked by ``validate_sweep``)."""


def fmt_setting(k: str, q: str, topk: int | None = None) -> str:
    s = f"k={k} q={q}"
    return s if topk is None else f"{s} index_topk={topk}"


def patch_lines(patch: str | None) -> list[str]:
    """The verdict's first line when every row carries a patch (a planted or deployed fault)."""
    if patch is None:
        return []
    return [
        f"every row carries the patch {patch}: no setting here removes it, so one that restores "
        "recall under it is a workaround while it stays; the fix is to remove the patch "
        "(needlescope investigate measures that)"
    ]


def workaround_lines(workarounds: list[dict], target: int, what: str) -> list[str]:
    """One 'not a fix' line per setting that restores the target only by reading every entry."""
    return [
        f"not a fix: {fmt_setting(w['index_k'], w['index_q'], w['index_topk'])} restores {what} at "
        f"{target} tokens ({w['rate']:.2f}) only by reading every entry (k {w['k_used']} >= "
        f"{target // 4} entries): a capacity workaround"
        for w in workarounds
    ]


def validate_sweep(obj: dict) -> None:
    """Raise ValueError unless ``obj`` follows SWEEP_SCHEMA and its counting invariants."""
    check_schema(obj, SWEEP_SCHEMA, "sweep")
    for c in obj["cells"]:
        if c["scored"] + c["unscored"] != c["cases"] or not 0 <= c["selected"] <= c["scored"]:
            raise ValueError(
                f"sweep: cell {c['index_k']}/{c['index_q']}/{c['index_topk']}/{c['length']}: bad counts"
            )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_sweep_md(obj: dict) -> str:
    """Markdown summary of sweep.json: verdict, then a rate table per setting × length."""
    lengths = obj["lengths"]
    judged = obj.get("judged_by", "answer_recall" if obj["generate"] else "selection_rate")
    what = "answer recall" if judged == "answer_recall" else "needle selection rate"
    lines = [
        f"# needlescope indexer sweep: {obj['model'] or 'model'} ({obj['kind']})",
        "",
        *(
            [
                f"**Every row carries the patch `{obj['patch']}`**: a setting that restores recall under it "
                "is a workaround while the patch stays, not the fix.",
                "",
            ]
            if obj.get("patch")
            else []
        ),
        f"Target: {what} >= {obj['target_rate']:g} at {obj['target_length']} tokens. "
        f"Scores accumulated in {obj.get('score_dtype', 'fp32')}. A case counts as selected when every CSA "
        "layer that can see the needle has a needle entry in its top-k at the first answer position.",
        "",
        "## Verdict",
        "",
        *[f"- {v}" for v in obj["verdict"]],
        "",
        "## Needle selection rate" + (" / answer recall" if obj["generate"] else ""),
        "",
        "| setting | restored to | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    cell = {(c["index_k"], c["index_q"], c["index_topk"], c["length"]): c for c in obj["cells"]}
    starred = inconsistent = False
    for s in obj["settings"]:
        key = (s["index_k"], s["index_q"], s["index_topk"])
        vals = []
        for n in lengths:
            c = cell.get((*key, n))
            if c is None:
                vals.append("-")
                continue
            v = _pct(c["selection_rate"])
            if obj["generate"]:
                v += f" / {_pct(c['answer_recall'])}"
            if c["unscored"]:
                v += f" ({c['unscored']} unscored)"
            if c.get("k_used", key[2]) >= n // 4:
                v += " *"
                starred = True
            if c.get("rank_inconsistent"):
                v += " !"
                inconsistent = True
            vals.append(v)
        reach = s["restored_to"] if s["restored_to"] is not None else "none"
        lines.append(f"| {fmt_setting(*key)} | {reach} | " + " | ".join(vals) + " |")
    if starred:
        lines += [
            "",
            "`*`: the k the indexer actually used is >= length/4, so every visible entry fits in the top-k "
            "and selection is trivial.",
        ]
    if inconsistent:
        lines += [
            "",
            "`!`: a needle rank within k while the needle was not selected; the ranked scores disagree with "
            "the selection (see runs[].layers[].rank_consistent).",
        ]
    return "\n".join(lines) + "\n"
