"""Report sections shared by probe outputs: the failure taxonomy and the per-endpoint breakdown."""

from __future__ import annotations

__all__ = ["FAILURES_SCHEMA", "ENDPOINTS_SCHEMA", "failure_lines", "endpoint_lines"]

_CROSS_CASE = {
    "type": "object",
    "required": ["count", "wrong_values", "chance", "p_value", "significant", "sent_before_s_median"],
    "properties": {
        "count": {"type": "integer"},
        "wrong_values": {"type": "integer"},
        "chance": {"type": "number"},
        "p_value": {"type": "number"},
        "significant": {"type": "boolean"},
        "same_connection": {"type": "integer"},
        "other_connection": {"type": "integer"},
        "connection_unknown": {"type": "integer"},
        "sources": {"type": "integer"},
        "sent_before_s_median": {"type": ["number", "null"]},
    },
}

FAILURES_SCHEMA: dict = {
    "type": "object",
    "required": ["misses", "errors", "counts", "examples"],
    "properties": {
        "misses": {"type": "integer"},
        "errors": {"type": "integer"},
        "counts": {"type": "object"},
        "examples": {"type": "object"},
        "cross_case": _CROSS_CASE,
    },
}

_GROUP = {
    "type": "object",
    "required": ["name", "n", "correct", "recall", "rest_recall", "p_value", "p_holm"],
    "properties": {
        "name": {"type": "string"},
        "n": {"type": "integer"},
        "correct": {"type": "integer"},
        "recall": {"type": ["number", "null"]},
        "rest_recall": {"type": ["number", "null"]},
        "p_value": {"type": "number"},
        "p_holm": {"type": "number"},
    },
}

ENDPOINTS_SCHEMA: dict = {
    "type": "object",
    "required": ["endpoints", "replicas", "differs", "replica_note"],
    "properties": {
        "endpoints": {"type": "array", "items": _GROUP},
        "replicas": {"type": "array", "items": _GROUP},
        "differs": {"type": "array", "items": {"type": "string"}},
        "replica_note": {"type": "string"},
    },
}


_EVIDENCE = (
    "value",
    "distractor_depth",
    "source_case",
    "sent_before_s",
    "same_connection",
    "edit_distance",
    "first_wrong",
)


def failure_lines(failures: dict) -> list[str]:
    """Markdown: counts per failure class and a few examples of each."""
    lines = [
        "## How answers failed",
        "",
        f"{failures['misses']} miss(es) classified; {failures['errors']} request error(s) are not misses.",
        "",
        "| class | count |",
        "|---|---|",
    ]
    lines += [f"| {c} | {n} |" for c, n in failures["counts"].items()]
    x = failures.get("cross_case")
    if x and x["count"]:
        lines += [
            "",
            f"Cross-case answers: {x['count']} miss(es) give the expected value of another case ({x['sources']} "
            f"source case(s)); each of the {x['wrong_values']} wrong values of the needles' digit count would "
            f"match another case's value by chance with probability {x['chance']:.2g}: exact binomial "
            f"p = {x['p_value']:.2g}" + (" (**significant**)." if x["significant"] else "."),
        ]
    for cat, examples in failures["examples"].items():
        lines += ["", f"**{cat}**", ""]
        for e in examples:
            evidence = ", ".join(f"{k}={e[k]}" for k in _EVIDENCE if k in e)
            lines.append(
                f"- `{e['case_id']}`: expected {', '.join(e['expected'])}, answered {e['answer']!r}"
                + (f" ({evidence})" if evidence else "")
            )
    return lines + [""]


def endpoint_lines(breakdown: dict) -> list[str]:
    """Markdown: recall per endpoint and replica, each tested against the rest."""
    lines = [
        "## By endpoint",
        "",
        "| endpoint | n | recall | recall of the rest | p (Fisher) | p (Holm) |",
        "|---|---|---|---|---|---|",
    ]
    for e in breakdown["endpoints"] + breakdown["replicas"]:
        rec = "-" if e["recall"] is None else f"{e['recall']:.2f}"
        rest = "-" if e["rest_recall"] is None else f"{e['rest_recall']:.2f}"
        lines.append(f"| {e['name']} | {e['n']} | {rec} | {rest} | {e['p_value']:.2g} | {e['p_holm']:.2g} |")
    lines.append("")
    if breakdown["differs"]:
        lines.append(f"**Worse than the rest (Holm-corrected p < 0.05):** {', '.join(breakdown['differs'])}")
    else:
        lines.append("No endpoint is worse than the rest (Holm-corrected p < 0.05).")
    lines += ["", f"Replicas: {breakdown['replica_note']}.", ""]
    return lines
