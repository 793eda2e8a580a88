"""The in-process route: ``measure(session) -> Measured``, the candidate and every ablation run
in this process on the reference checkpoint (the steps are in ``investigate.run``'s docstring).

Each function takes a ``session.Session`` and records evidence and pairs; none decides a verdict
(``decide.decision.decide`` does, from the returned ``Measured``). What to measure after the
ablations (the residual, the localizer, the characterization) is asked of ``decide.decision``,
whose rules say it. Suspects absent from the candidate
with no causal check are left to the configuration check (``presence_check``) and the cheap
questions, and the measured record says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from needlescope.investigate.decide.causal import recall_by_length
from needlescope.investigate.decide.decision import (
    characterization_needed,
    decide_inprocess_suspects,
    localization_target,
)
from needlescope.investigate.decide.measured import Measured
from needlescope.investigate.decide.verdicts import evidence, paired
from needlescope.investigate.ledger.differences import AUTO_PREFIX, file_slug, presence_check, present_in
from needlescope.investigate.ledger.ledger import Suspect
from needlescope.investigate.ledger.plan import Config
from needlescope.investigate.measure.causal import sufficiency
from needlescope.investigate.measure.session import Session, outcomes, suspect_identity

__all__ = [
    "measure",
    "CANDIDATE_ONLY",
    "Symptom",
    "measure_symptom",
    "measure_suspect",
    "replay_fixes",
    "explained_record",
]

CANDIDATE_ONLY = "right under the reference, wrong under the candidate"


@dataclass(frozen=True)
class Symptom:
    """The reference and the candidate measured on the probe cases, and the case explained:
    ``explained`` {"case_id", "why"} (None when no model ran), ``probe_case`` the case the
    audit checks and the final-logit divergence run on."""

    reference: list[dict]
    candidate: list[dict]
    explained: dict | None = None
    probe_case: object = None


def _explained_case(ref_records, cand_records) -> tuple[str | None, str]:
    ref_ok = {r["case_id"] for r in ref_records if r["correct"]}
    misses = sorted(
        (r for r in cand_records if not r["correct"]), key=lambda r: (-r["length"], r["depth"], r["trial"])
    )
    for r in misses:
        if r["case_id"] in ref_ok:
            return r["case_id"], CANDIDATE_ONLY
    if misses:
        return misses[0]["case_id"], "wrong under both (no candidate-only failure)"
    return None, "the candidate answered every case correctly"


def measure_symptom(session: Session) -> Symptom:
    """The reference and the candidate on every case, and the failing case to explain (the
    longest candidate-only failure); nothing measured when the checkpoint is missing."""
    if not session.loaded:
        return Symptom([], [])
    ref_records = session.measure("reference", session.reference)
    cand_records = session.measure("candidate", session.candidate)
    case_id, why = _explained_case(ref_records, cand_records)
    probe_case = next(
        (c for c in session.cases if c.case_id == case_id), max(session.cases, key=lambda c: c.length)
    )
    return Symptom(ref_records, cand_records, {"case_id": case_id, "why": why}, probe_case)


def _audit(session: Session, s: Suspect, check: str, sy: Symptom) -> None:
    """Run ``audit:NAME`` on the probe case's prompt; its metrics become evidence."""
    import torch

    from needlescope.audit.checks import run_check
    from needlescope.dsa.prompt import render_prompt
    from needlescope.investigate.measure.records import applied

    def apply_candidate(model):
        cm = applied(model, session.candidate)
        cm.__enter__()
        return lambda: cm.__exit__(None, None, None)

    ids = torch.tensor(
        [render_prompt(session.tokenizer, sy.probe_case.messages).input_ids],
        device=next(session.model.parameters()).device,
    )
    ctx = {
        "candidate_topk": sy.candidate[0]["index_topk"],
        "reference_records": sy.reference,
        "apply_candidate": apply_candidate,
        "chunk": session.chunk,
    }
    res = run_check(check.split(":", 1)[1], session.model, ids, ctx)
    session.state.add_evidence(
        s.id,
        [evidence(check, m["metric"], m["value"], m["threshold"]) for m in res["metrics"]]
        + [evidence(check, f"flagged ({res['why']})", "yes" if res["flagged"] else "no")],
    )


def _ablation(session: Session, s: Suspect, present: bool, sy: Symptom) -> tuple[dict, float]:
    """(pair, divergence): the paired ablation and the final-logit divergence of ``s`` added
    alone to the reference; both recorded as evidence."""
    from needlescope.investigate.measure.records import final_logits

    if present:
        recs = session.measure(f"remove-{file_slug(s.id)}", session.removal(s))
        pair = paired(outcomes(sy.candidate), outcomes(recs))
    else:
        recs = session.measure(f"add-{file_slug(s.id)}", session.addition(s))
        pair = paired(outcomes(recs), outcomes(sy.reference))
    messages, chunk = sy.probe_case.messages, session.chunk
    a = final_logits(session.model, session.tokenizer, messages, session.reference, chunk=chunk)
    b = final_logits(session.model, session.tokenizer, messages, session.addition(s), chunk=chunk)
    divergence = float((b - a).norm() / a.norm())
    how = "removed from the candidate" if present else "added alone to the reference"
    session.state.add_evidence(
        s.id,
        [
            evidence("ablation", f"recall with {s.id} ({how}; paired)", pair["recall_with"]),
            evidence("ablation", f"recall without {s.id}", pair["recall_without"]),
            evidence("ablation", "discordant b (wrong with, right without)", pair["b"]),
            evidence("ablation", "discordant c (right with, wrong without)", pair["c"]),
            evidence("ablation", "exact McNemar p", pair["p"]),
            evidence(
                "divergence",
                f"final-logit relative error, {s.id} added alone to the reference ({sy.probe_case.case_id})",
                divergence,
            ),
        ],
    )
    return pair, divergence


def measure_suspect(session: Session, s: Suspect, sy: Symptom) -> dict:
    """The measured record of ``s``: its presence, its audit checks and ablation (when asked and
    not ruled out by a cheap question), its sufficiency when present; and what blocked or
    skipped a check. Evidence, never a verdict (``decide.causal.decide``)."""
    cand, ref = session.candidate, session.reference
    present = present_in(s, cand.setting, cand.extra, ref.setting)
    presence = presence_check(s, cand.setting, cand.extra, ref.setting, session.ledger.path.parent)
    session.state.add_evidence(s.id, [evidence("presence", presence, "present" if present else "absent")])
    blocked, ran = [], 0
    absent_q = session.absent_by_question(s.id)
    pair = divergence = suff = None
    if s.id.startswith(AUTO_PREFIX) and not s.checks:
        blocked.append(
            "ablation: an environment variable, a server field or a patch only the reference carries "
            "cannot be removed from or added to the in-process model; map it to a patch or setting suspect"
        )
    for check in s.checks if absent_q is None else ():
        if not session.loaded:
            blocked.append(f"{check}: {session.blocked_reason}")
        elif check.startswith("audit:"):
            _audit(session, s, check, sy)
            ran += 1
        elif check == "ablation":
            pair, divergence = _ablation(session, s, present, sy)
            if present:
                suff = sufficiency(session, s, sy.reference)
            ran += 1
    return {
        **suspect_identity(s),
        "present": present,
        "pair": pair,
        "divergence": divergence,
        "sufficiency": suff,
        "absent_by_question": absent_q,
        "blocked": blocked,
        "ran_checks": ran,
        "presence": presence,
        "questions": session.question_summary(s.id),
    }


def _fix_configs(session: Session, measured: list[dict], k: int) -> list[tuple[str, Config, str | None]]:
    """(name, config, removed suspect id) of every fix to replay: each present suspect's removal,
    and the candidate at twice its ``index_topk`` (unless that is the checkpoint's own top-k)."""
    by_id = {s.id: s for s in session.suspects}
    cfgs = [
        (f"remove-{file_slug(m['id'])}", session.removal(by_id[m["id"]]), m["id"])
        for m in measured
        if m["present"] and m["id"] in by_id and (by_id[m["id"]].patch or by_id[m["id"]].setting_fields)
    ]
    cand = session.candidate
    if 2 * k < int(session.model.config.index_topk):
        cfgs.append((f"topk-{2 * k}", Config(cand.setting.with_(index_topk=2 * k), cand.extra), None))
    return cfgs


def replay_fixes(session: Session, measured: list[dict], sy: Symptom) -> tuple[list, list]:
    """(fixes, topk_runs): every fix paired with the candidate (unlabelled: ``decide`` labels
    them), and the runs that differ from the candidate only in ``index_topk`` (the candidate
    included) for the collapse test."""
    if not session.loaded:
        return [], []
    cand, cand_records = session.candidate, sy.candidate
    k = cand_records[0]["index_topk"]
    fixes, topk_runs = [], []
    for name, cfg, removes in _fix_configs(session, measured, k):
        recs = session.measure(name, cfg)
        fixes.append(
            {
                "name": name,
                "label": cfg.label(),
                "removes": removes,
                "index_topk": recs[0]["index_topk"],
                "keeps_topk": recs[0]["index_topk"] == k,
                "changes": "kernel"
                if cfg.setting.patch != cand.setting.patch or cfg.extra != cand.extra
                else "config",
                "pair": paired(outcomes(cand_records), outcomes(recs)),
                "recall_by_length": recall_by_length(recs),
                "case": next((r for r in recs if r["case_id"] == (sy.explained or {}).get("case_id")), None),
            }
        )
        if cfg.setting.with_(index_topk=cand.setting.index_topk) == cand.setting and cfg.extra == cand.extra:
            topk_runs.append(_topk_run(recs))
    topk_runs.append(_topk_run(cand_records))
    return fixes, topk_runs


def _topk_run(recs: list[dict]) -> dict:
    return {
        "index_topk": recs[0]["index_topk"],
        "compress_ratio": recs[0]["compress_ratio"],
        "cases": [{"case_id": r["case_id"], "length": r["length"], "correct": r["correct"]} for r in recs],
    }


def explained_record(sy: Symptom) -> dict | None:
    """``investigation.json`` ``explained``: the explained case with both records (None if none)."""
    if not sy.explained or not sy.explained["case_id"]:
        return None
    cid = sy.explained["case_id"]
    return {
        **sy.explained,
        "candidate": next(r for r in sy.candidate if r["case_id"] == cid),
        "reference": next(r for r in sy.reference if r["case_id"] == cid),
    }


def measure(session: Session) -> Measured:
    """Every in-process measurement of the run (module docstring), resumable."""
    from needlescope.investigate.measure.causal import residual
    from needlescope.investigate.measure.characterize import measure_characterization_inprocess
    from needlescope.investigate.measure.localize import localize_residual
    from needlescope.investigate.measure.rank_paths import failing_rank_paths
    from needlescope.investigate.measure.session import measure_suspects, nonfinite_summary

    sy = measure_symptom(session)
    measured = measure_suspects(session, lambda s: measure_suspect(session, s, sy))
    fixes, topk_runs = replay_fixes(session, measured, sy)
    # what to measure next follows from the decisions so far: ``decide`` states the rules
    suspects, decided, _ = decide_inprocess_suspects(measured, sy.reference, sy.candidate, topk_runs)
    res = loc = char = None
    if session.loaded:
        removed, res_cfg, res_recs = residual(session, suspects, sy.candidate)
        res = {
            "removed": removed,
            "config": res_cfg.label(),
            "pair": paired(outcomes(res_recs), outcomes(sy.reference)),
        }
        where = localization_target(res["pair"], suspects)
        if where == "residual":
            loc = localize_residual(session, res_cfg, res_recs, sy.reference)
        elif where == "candidate":
            loc = localize_residual(
                session,
                session.candidate,
                sy.candidate,
                sy.reference,
                "the candidate (its root cause is not named by the ledger)",
            )
        if characterization_needed("in-process", sy.reference, sy.candidate, suspects, decided["root_cause"]):
            char = measure_characterization_inprocess(session, suspects, sy.reference, sy.candidate)
    nonfinite = nonfinite_summary(session)  # before the rank paths, as a run always counted them
    return session.measured(
        measured,
        route="in-process",
        target={"model": session.ledger.target.model, "device": session.ledger.target.device},
        candidate_label=session.candidate.label(),
        reference_records=sy.reference,
        candidate_records=sy.candidate,
        candidate_topk=sy.candidate[0]["index_topk"] if sy.candidate else None,
        fixes=fixes,
        topk_runs=topk_runs,
        explained=explained_record(sy),
        residual=res,
        localization=loc,
        characterization=char,
        rank_paths=failing_rank_paths(session, sy.explained, CANDIDATE_ONLY, sy.candidate),
        nonfinite_scores=nonfinite,
    )
