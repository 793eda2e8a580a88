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

from needlescope.investigate.decide.verdicts import evidence, paired
from needlescope.investigate.ledger.differences import file_slug
from needlescope.investigate.ledger.ledger import Suspect
from needlescope.investigate.ledger.plan import Config, at_topk
from needlescope.investigate.measure.session import Session, outcomes

__all__ = ["sufficiency", "residual_config", "residual"]


def sufficiency(session: Session, s: Suspect, ref_records: list[dict]) -> dict:
    """The pair (with = ``s`` added alone to the reference at the deployment top-k, without =
    that reference; for the capacity suspect: the reference at the deployment top-k against
    the reference), recorded as evidence."""
    base = at_topk(session.reference, session.candidate.setting.index_topk)
    changes_topk = any(f == "index_topk" for f, _ in s.setting_fields)
    with_recs = session.measure(
        f"alone-{file_slug(s.id)}", base if changes_topk else session.addition(s, base)
    )
    without = (
        ref_records if changes_topk or base is session.reference else session.measure("reference-at-k", base)
    )
    pair = paired(outcomes(with_recs), outcomes(without))
    session.state.add_evidence(
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
            evidence("sufficiency", "sufficiency: exact McNemar p", pair["p"]),
        ],
    )
    return pair


def residual_config(session: Session, removed: list[Suspect]) -> Config:
    """The candidate with every suspect of ``removed`` taken out."""
    cfg = session.candidate
    for s in removed:
        cfg = session.removal(s, cfg)
    return cfg


def residual(
    session: Session, decided: list[dict], cand_records: list[dict]
) -> tuple[list[str], Config, list]:
    """(removed ids, the residual config, its case records): the candidate with every implicated
    suspect present in it taken out (the candidate itself when none is); ``decide.verdicts.
    residual_verdict`` judges it."""
    by_id = {s.id: s for s in session.suspects}
    removed = [s["id"] for s in decided if s["verdict"] == "implicated" and s["present"]]
    cfg = residual_config(session, [by_id[i] for i in removed])
    recs = session.measure("residual", cfg) if removed else cand_records
    return removed, cfg, recs
