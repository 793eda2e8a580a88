"""The dump route's decision: a tensor dump answers *where* the candidate diverges, not *which
suspect* caused it, so a suspect is exonerated when its cheap questions show it absent and
inconclusive otherwise (``measure.dump``)."""

from __future__ import annotations

__all__ = ["decide_dump"]


def decide_dump(m: dict) -> dict:
    """One dump-route suspect's decided record from its measured record ``m``."""
    ident = {k: m[k] for k in ("id", "tier", "hypothesis", "maps_to", "changes_topk", "auto")}
    questions = m["questions"] or "none asked"
    if m["absent_by_question"] is not None:
        verdict, present = "exonerated", False
        reason = f"not in the deployment: {m['absent_by_question']} (cheap questions: {questions})"
    else:
        verdict, present = "inconclusive", None
        reason = (
            "a tensor dump cannot be ablated, and the cheap questions alone do not decide "
            f"(cheap questions: {questions}); see where the divergence starts"
        )
    empty = {"pair": None, "divergence": None, "sufficiency": None}
    return {**ident, "verdict": verdict, "reason": reason, **empty, "present": present}
