"""Necessity, sufficiency, multiplicity and the residual of an in-process investigation.

* **Sufficiency** (``sufficiency``): a suspect present in the candidate is also added alone to
  the reference at the deployment's ``index_topk`` and paired against that reference
  (``index_topk`` is a capacity knob: a bug that costs recall at the deployment's top-k is
  sufficient there; the capacity suspect itself is the reference at the deployment's top-k
  against the reference). Same cases as every other configuration; a configuration equal to
  one already measured (a removal often is) is copied, not measured again.
* **Decisions** (``decide``): Holm-adjusted p-values across the run's ablations (one test per
  suspect with a paired ablation), and separately across the sufficiency tests; each verdict
  re-derived on its adjusted p with the power of its ablation (``verdicts.power_check``: a
  negative verdict states the cost it could detect, and is ``inconclusive`` when that exceeds
  the symptom or ``BOUND_FLOOR``); then the roles (root cause, co-factor, workaround).
* **Residual** (``residual``): the candidate with every implicated suspect removed, paired
  against the reference; when no suspect is implicated, the whole candidate.
"""

from __future__ import annotations

from needlescope.investigate.differences import file_slug
from needlescope.investigate.verdicts import (
    ALPHA,
    evidence,
    holm_adjust,
    paired,
    power_check,
    residual_verdict,
    resolve_root_cause,
    restores,
    suspect_verdict,
)

__all__ = ["reference_at_k", "sufficiency", "decide", "residual_config", "residual", "symptom_loss"]


def reference_at_k(inv):
    """The reference at the candidate's ``index_topk`` (the reference itself when they agree)."""
    r, k = inv.reference, inv.candidate.setting.index_topk
    return r if r.setting.index_topk == k else inv.Config(r.setting.with_(index_topk=k), r.extra)


def sufficiency(inv, s, ref_records: list[dict]) -> dict:
    """The pair (with = ``s`` added alone to the reference at the deployment top-k, without =
    that reference; for the capacity suspect: the reference at the deployment top-k against
    the reference), recorded as evidence."""
    base = reference_at_k(inv)
    changes_topk = any(f == "index_topk" for f, _ in s.setting_fields)
    with_recs = inv.measure(f"alone-{file_slug(s.id)}", base if changes_topk else inv.addition(s, base))
    without = ref_records if changes_topk or base is inv.reference else inv.measure("reference-at-k", base)
    pair = paired(inv.correct(with_recs), inv.correct(without))
    inv.state.add_evidence(
        s.id,
        [
            evidence(
                "sufficiency",
                f"sufficiency: recall with {s.id} added alone to the reference at the deployment index_topk",
                pair["recall_with"],
            ),
            evidence(
                "sufficiency", "sufficiency: recall of that reference without it", pair["recall_without"]
            ),
            evidence(
                "sufficiency", "sufficiency: discordant b (wrong with it alone, right without)", pair["b"]
            ),
            evidence("sufficiency", "sufficiency: discordant c", pair["c"]),
            evidence("sufficiency", "sufficiency: exact McNemar p", pair["p"], ALPHA),
        ],
    )
    return pair


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


def residual_config(inv, removed: list):
    """The candidate with every suspect of ``removed`` (``Suspect`` objects) taken out."""
    cfg = inv.candidate
    for s in removed:
        cfg = inv.removal(s, cfg)
    return cfg


def residual(inv, suspects_out: list[dict], ref_records, cand_records) -> tuple[dict, object, list]:
    """(residual record for verdicts.json, the residual config, its case records)."""
    by_id = {s.id: s for s in inv.suspects}
    removed = [s["id"] for s in suspects_out if s["verdict"] == "implicated" and s["present"]]
    cfg = residual_config(inv, [by_id[i] for i in removed])
    recs = inv.measure("residual", cfg) if removed else cand_records
    out = residual_verdict(paired(inv.correct(recs), inv.correct(ref_records)), removed)
    return {**out, "config": cfg.label()}, cfg, recs
