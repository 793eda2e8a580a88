"""The causal measurements of an in-process investigation: sufficiency and the residual
(the decisions on them: ``decide.causal``).

* **Sufficiency** (``sufficiency``): a suspect present in the candidate is also added alone to
  the reference at the deployment's ``index_topk`` and paired against that reference
  (``index_topk`` is a capacity knob: a bug that costs recall at the deployment's top-k is
  sufficient there; the capacity suspect itself is the reference at the deployment's top-k
  against the reference). Same cases as every other configuration; a configuration equal to
  one already measured (a removal often is) is copied, not measured again.
* **Residual** (``residual``): the candidate with every implicated suspect removed, paired
  against the reference; when no suspect is implicated, the whole candidate.
"""

from __future__ import annotations

from needlescope.investigate.decide.verdicts import ALPHA, evidence, paired, residual_verdict
from needlescope.investigate.ledger.differences import file_slug

__all__ = ["reference_at_k", "sufficiency", "residual_config", "residual"]


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
