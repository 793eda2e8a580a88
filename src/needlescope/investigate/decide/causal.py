"""Necessity, sufficiency and multiplicity of an in-process investigation: the decisions.

* **Decisions** (``decide_suspects``): Holm-adjusted p-values across the run's ablations (one test per
  suspect with a paired ablation), and separately across the sufficiency tests; each verdict
  decided on its adjusted p with the power of its ablation (``verdicts.power_check``: a
  negative verdict states the cost it could detect, and is ``inconclusive`` when that exceeds
  the symptom or ``BOUND_FLOOR``); then the roles (root cause, co-factor, workaround).
* **Symptom loss** (``symptom_loss``): the candidate's paired recall loss, the cost a negative
  verdict must be able to detect.
"""

from __future__ import annotations

from needlescope.analysis.curve import pool_by_length
from needlescope.investigate.decide.verdicts import (
    ALPHA,
    classify_fix,
    holm_adjust,
    paired,
    power_check,
    resolve_root_cause,
    restores,
    root_causes,
    suspect_verdict,
)

__all__ = ["decide_suspects", "label_fixes", "symptom_loss", "recall_by_length"]


def symptom_loss(ref_records: list[dict], cand_records: list[dict]) -> float:
    """The candidate's paired recall loss against the reference (0 when it loses nothing)."""
    ok = lambda rs: {r["case_id"]: r["correct"] for r in rs if not r.get("error")}  # noqa: E731
    p = paired(ok(cand_records), ok(ref_records))
    return max(0.0, (p["b"] - p["c"]) / p["n"]) if p["n"] else 0.0


_MEASURED = ("absent_by_question", "blocked", "ran_checks", "presence", "questions")
"""The keys of a measured record ``suspect_verdict`` reads besides the pair and divergence."""


def _sufficiency_text(sf: dict | None, p_adj: float | None, sufficient: bool | None) -> str:
    """The clause a verdict's reason carries about sufficiency ("" when none was measured)."""
    if sf is None:
        return ""
    return (
        f"; added alone to the reference at the deployment index_topk: recall {sf['recall_with']:.2f} vs "
        f"{sf['recall_without']:.2f}, b={sf['b']} c={sf['c']}, Holm-adjusted p={p_adj:.3g}: "
        f"{'sufficient' if sufficient else 'not sufficient'} on its own"
    )


def _decided(m: dict, p_adj, sp, tests: int, loss: float) -> dict:
    """One suspect's decided record from its measured record ``m`` (a new dict)."""
    rest = {k: v for k, v in m.items() if k not in _MEASURED}
    pair, suff = m["pair"], m["sufficiency"]
    power = power_check(pair["n"], tests, loss) if pair is not None else None
    sufficient = restores(suff, sp) if suff is not None else None
    verdict, reason = suspect_verdict(
        **{k: m[k] for k in _MEASURED},
        present=m["present"],
        pair=pair,
        divergence=m["divergence"],
        p_adjusted=p_adj if pair is not None else None,
        power=power,
    )
    return {
        **rest,
        "verdict": verdict,
        "reason": reason + _sufficiency_text(suff, sp, sufficient) if pair is not None else reason,
        "p_holm": p_adj,
        "necessary": restores(pair, p_adj) if pair is not None and m["present"] else None,
        "sufficient": sufficient,
        "role": None,
        "power": power,
    }


def decide_suspects(measured: list[dict], loss: float, signature_fires: bool) -> tuple[list[dict], dict]:
    """Every in-process suspect's verdict, decided once from its measured record
    (``inprocess.measure_suspect``: present, pair, divergence, sufficiency, what blocked it, the
    cheap questions' answers): Holm-adjusted p-values across the run's ablations and, separately,
    across the sufficiency tests; each verdict on its adjusted p with its ablation's power; then
    the roles and the root cause (``resolve_root_cause``, a new value joined in once).
    ``measured`` is not changed.

    Returns (decided suspect records, {"root_cause", "multiplicity"})."""
    pairs = [m["pair"] for m in measured]
    adj = holm_adjust(pairs)
    suff_adj = holm_adjust([m["sufficiency"] for m in measured])
    tests = sum(p is not None for p in pairs)
    causal = [_decided(m, p, sp, tests, loss) for m, p, sp in zip(measured, adj, suff_adj)]
    root, roles = resolve_root_cause(causal, signature_fires)
    suspects = [
        {**s, "verdict": r.verdict, "reason": r.reason, "role": r.role} if (r := roles.get(s["id"])) else s
        for s in causal
    ]
    return suspects, {"root_cause": root, "multiplicity": {"method": "holm", "tests": tests, "alpha": ALPHA}}


def label_fixes(fixes: list[dict], suspects: list[dict], root: str | None) -> list[dict]:
    """Each replayed fix with its ``label_kind`` (``verdicts.classify_fix``) against the decided
    root causes (new dicts)."""
    roots = root_causes(suspects) or root
    return [
        {
            **f,
            "label_kind": classify_fix(
                f["pair"], removes=f["removes"], root_cause=roots, keeps_topk=f["keeps_topk"]
            ),
        }
        for f in fixes
    ]


def recall_by_length(records: list[dict]) -> dict[str, float]:
    """Recall per prompt length (as text keys, ascending) over ``records`` (errors left out)."""
    pooled = pool_by_length((r["length"], int(r["correct"]), 1) for r in records if not r.get("error"))
    return {str(n): c / k for n, (c, k) in pooled.items()}
