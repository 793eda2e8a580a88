"""Necessity, sufficiency and multiplicity of an in-process investigation: the decisions.

* **Decisions** (``decide``): Holm-adjusted p-values across the run's ablations (one test per
  suspect with a paired ablation), and separately across the sufficiency tests; each verdict
  re-derived on its adjusted p with the power of its ablation (``verdicts.power_check``: a
  negative verdict states the cost it could detect, and is ``inconclusive`` when that exceeds
  the symptom or ``BOUND_FLOOR``); then the roles (root cause, co-factor, workaround).
* **Symptom loss** (``symptom_loss``): the candidate's paired recall loss, the cost a negative
  verdict must be able to detect.
"""

from __future__ import annotations

from needlescope.investigate.decide.verdicts import (
    ALPHA,
    holm_adjust,
    paired,
    power_check,
    resolve_root_cause,
    restores,
    suspect_verdict,
)

__all__ = ["decide", "symptom_loss"]


def symptom_loss(ref_records: list[dict], cand_records: list[dict]) -> float:
    """The candidate's paired recall loss against the reference (0 when it loses nothing)."""
    ok = lambda rs: {r["case_id"]: r["correct"] for r in rs if not r.get("error")}  # noqa: E731
    p = paired(ok(cand_records), ok(ref_records))
    return max(0.0, (p["b"] - p["c"]) / p["n"]) if p["n"] else 0.0


def decide(suspects: list[dict], loss: float, signature_fires: bool) -> dict:
    """Re-derive every measured suspect's verdict on Holm-adjusted p-values with its power, set
    ``necessary`` / ``sufficient`` / ``role``, resolve the root cause (in place). Returns
    {"root_cause", "multiplicity"}."""
    pairs = [s.get("pair") for s in suspects]
    adj = holm_adjust(pairs)
    suff_adj = holm_adjust([s.get("sufficiency") for s in suspects])
    tests = sum(p is not None for p in pairs)
    for s, p_adj, sp in zip(suspects, adj, suff_adj):
        s["p_holm"] = p_adj
        s["necessary"] = restores(s["pair"], p_adj) if s.get("pair") is not None and s["present"] else None
        s["sufficient"] = restores(s["sufficiency"], sp) if s.get("sufficiency") is not None else None
        s["role"] = None
        if s.get("pair") is None or "inputs" not in s:
            continue
        s["power"] = power_check(s["pair"]["n"], tests, loss)
        s["verdict"], s["reason"] = suspect_verdict(
            **s["inputs"],
            present=s["present"],
            pair=s["pair"],
            divergence=s["divergence"],
            p_adjusted=p_adj,
            power=s["power"],
        )
        if s["sufficiency"] is not None:
            sf = s["sufficiency"]
            s["reason"] += (
                f"; added alone to the reference at the deployment index_topk: recall {sf['recall_with']:.2f} vs "
                f"{sf['recall_without']:.2f}, b={sf['b']} c={sf['c']}, Holm-adjusted p={sp:.3g}: "
                f"{'sufficient' if s['sufficient'] else 'not sufficient'} on its own"
            )
    root = resolve_root_cause(suspects, signature_fires)
    return {"root_cause": root, "multiplicity": {"method": "holm", "tests": tests, "alpha": ALPHA}}
