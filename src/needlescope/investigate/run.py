"""``run_investigation(ledger, out, progress) -> Findings``: cheap questions, then the symptom,
then checks in tier order, then the fixes, the signature and the verdicts, all resumable from
``out``. It picks the route, decides every verdict once (``decide``), writes ``verdicts.json``
and ``investigation.json`` once each (both checked against their schemas) and returns the value.

Steps (each recorded in ``state.json`` as it finishes; see ``state.RunState``):

1. **questions**: every suspect's cheap questions, tier order; answers are evidence.
2. **symptom**: the reference and the candidate on the ledger's probe cases, in-process on the
   reference checkpoint (``measure.records.measure_case``); recall per length.
3. **checks**, tier order, per suspect: its audit checks (``needlescope.audit``) and its
   ablation (remove it from the candidate when present, else add it alone to the reference;
   paired on the same cases) plus the divergence of the final logits when added alone to the
   reference: evidence and pairs, no verdict (``measure.inprocess.measure_suspect``).
4. **fixes**: each present suspect's removal, and the candidate at twice its ``index_topk``;
   each paired with the candidate.
5. **verdicts**: the signature (``signature.signature``), then every verdict, the roles and
   the root cause at once (``decide.causal.decide``), the fix labels; the residual (the
   candidate without the implicated suspects), the localizer step and the rank paths;
   ``verdicts.json`` (``schema.VERDICTS_SCHEMA``) and ``investigation.json`` (everything the
   report needs, ``schema.INVESTIGATION_SCHEMA``).

A ledger with ``candidate = "live"`` takes the live-endpoint route instead
(``investigate.measure.live``): no ablation is possible, each suspect's emulation in the reference is
compared with the live indexer capture. One with ``candidate = "dump"`` takes the dump route
(``investigate.measure.dump``): the localization comes from the engine's tensor dump compared with
the reference.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from needlescope.investigate.decide.causal import decide, label_fixes, recall_by_length, symptom_loss
from needlescope.investigate.decide.dump import decide_dump
from needlescope.investigate.decide.findings import Findings, build_verdicts, validate_findings
from needlescope.investigate.decide.live import decide_live, live_root_cause
from needlescope.investigate.decide.signature import NO_SIGNATURE, signature
from needlescope.investigate.decide.verdicts import paired, residual_verdict, root_causes
from needlescope.investigate.ledger.differences import AUTO_PREFIX
from needlescope.investigate.ledger.ledger import load_ledger, with_chunk
from needlescope.investigate.measure import inprocess
from needlescope.investigate.measure.causal import residual
from needlescope.investigate.measure.characterize import characterize_inprocess, characterize_live
from needlescope.investigate.measure.dump import DumpRoute
from needlescope.investigate.measure.live import LiveRoute, live_localization
from needlescope.investigate.measure.localize import localize_residual
from needlescope.investigate.measure.rank_paths import failing_rank_paths
from needlescope.investigate.measure.session import Session, measure_suspects, nonfinite_summary, outcomes
from needlescope.investigate.measure.state import run_lock
from needlescope.paths import atomic_write_json, relativize
from needlescope.progress import Progress, no_progress

__all__ = ["run_investigation"]


def run_investigation(
    ledger_path: str | Path,
    out: str | Path,
    progress: Progress = no_progress,
    *,
    loaded=None,
    allow_outside: bool = False,
    prefill_chunk: int | None = None,
    api_key: str | None = None,
    serving_factors: bool = False,
) -> Findings:
    """Run (or resume) the investigation of ``ledger_path`` into ``out``; returns its ``Findings``.

    ``loaded``: an already loaded (model, tokenizer) of the ledger's checkpoint, to reuse it.
    A ledger whose candidate is ``live`` takes the live-endpoint route (``measure.live``), one
    whose candidate is ``dump`` the dump route (``measure.dump``).
    ``allow_outside``: accept ledger paths outside its folder (``--allow-outside``).
    ``prefill_chunk``: overrides the ledger's ``[target] prefill_chunk`` (``--prefill-chunk``).
    ``api_key``: the live endpoint's bearer key (``--api-key``; never in the ledger or the run).
    ``serving_factors``: a live run that loses recall names the serving factor that reproduces
    it (``--serving-factors``; ``measure.serving_factors``)."""
    ledger = with_chunk(load_ledger(ledger_path, allow_outside=allow_outside), prefill_chunk)
    with run_lock(Path(out)):  # one run at a time writes a run directory
        session = Session(ledger, Path(out), progress, api_key=api_key)
        session.serving_factors = serving_factors
        session.questions()
        session.load(loaded)
        if ledger.target.live:
            investigation = _live(session)
        elif ledger.target.dump is not None:
            investigation = _dump(session)
        else:
            investigation = _in_process(session)
        return _write(session, investigation)


def _in_process(session: Session) -> dict:
    """Measure, decide once, then measure what the decisions leave unexplained; the
    ``investigation.json`` content of an in-process run."""
    sy = inprocess.measure_symptom(session)
    measured = measure_suspects(session, lambda s: inprocess.measure_suspect(session, s, sy))
    fixes, topk_runs = inprocess.replay_fixes(session, measured, sy)
    sig = signature(sy.candidate, topk_runs) if sy.candidate else NO_SIGNATURE
    suspects, decided = decide(
        measured, symptom_loss(sy.reference, sy.candidate), sig["uninformative_ranking"]
    )
    root = decided["root_cause"]
    extra = {
        "multiplicity": decided["multiplicity"],
        **_unexplained(session, suspects, sy),
        "rank_paths": failing_rank_paths(session, sy.explained, inprocess.CANDIDATE_ONLY, sy.candidate),
    }
    symptom = inprocess.symptom_record(session, sy)
    return {
        "route": "in-process",
        "ledger": session.ledger.path.name,
        "target": {"model": session.ledger.target.model, "device": session.ledger.target.device},
        "symptom": symptom,
        "configs": session.configs,
        "candidate_topk": sy.candidate[0]["index_topk"] if sy.candidate else None,
        "suspects": suspects,
        "fixes": label_fixes(fixes, suspects, root),
        "explained": inprocess.explained_record(sy),
        "verdicts": _verdicts(session, symptom, root, sig, suspects, **extra),
    }


def _unexplained(session: Session, suspects: list[dict], sy: inprocess.Symptom) -> dict:
    """The residual (judged by ``residual_verdict``), the localizer step when something is left
    unexplained (or a root cause is an automatic suspect, or cases are lost that no suspect
    explains), the characterization and the non-finite score counts."""
    out: dict = {}
    if session.loaded:
        removed, res_cfg, res_recs = residual(session, suspects, sy.candidate)
        pair = paired(outcomes(res_recs), outcomes(sy.reference))
        out["residual"] = {**residual_verdict(pair, removed), "config": res_cfg.label()}
        if out["residual"]["loses"]:
            out["localization"] = localize_residual(session, res_cfg, res_recs, sy.reference)
        elif any(r.startswith(AUTO_PREFIX) for r in root_causes(suspects)):
            # nobody named the root cause: show where in the model it acts (the candidate itself)
            out["localization"] = localize_residual(
                session,
                session.candidate,
                sy.candidate,
                sy.reference,
                "the candidate (its root cause is not named by the ledger)",
            )
        elif pair["b"] > pair["c"] and not root_causes(suspects):
            # a loss too small for the exact test and no suspect for it: the localizer is one of
            # the characterization's discriminating experiments (its `where` family)
            out["localization"] = localize_residual(session, res_cfg, res_recs, sy.reference)
    out["characterization"] = characterize_inprocess(
        session, suspects, sy.reference, sy.candidate, out.get("localization")
    )
    out["nonfinite_scores"] = nonfinite_summary(session)
    return out


def _live(session: Session) -> dict:
    """Measure against the live endpoint, decide once; the ``investigation.json`` content."""
    route = LiveRoute(session)
    ref_records, live_records, failing, baseline = route.measure_symptom()
    # the failing cases' answers and captures: a rerun that got more answers measures again
    basis = hashlib.sha256(json.dumps([route.live_k, failing], sort_keys=True).encode()).hexdigest()
    measured = measure_suspects(session, lambda s: route.measure_suspect(s, failing, baseline), basis)
    suspects = [decide_live(m) for m in measured]
    root = live_root_cause(suspects)
    ledger, t = session.ledger, session.ledger.target
    symptom = {
        **ledger.symptom.to_json(),
        "reference": session.reference.label(),
        "candidate": f"live endpoint {t.endpoint}",
        "recall_reference": recall_by_length(ref_records),
        "recall_candidate": recall_by_length(live_records),
        "cases": len(live_records),
        "errors": sum(1 for r in live_records if r.get("error")),
        "failing_cases": len(failing),
        "live_index_topk": route.live_k,
    }
    loc = (
        live_localization(failing, baseline.get("prefill", {}), route.needle_entries)
        if root is None
        else None
    )
    if loc is not None:
        loc["command"] = f"needlescope investigate run {ledger.path.name} --out {session.out.name}"
    return {
        "route": "live",
        "ledger": ledger.path.name,
        "target": {"model": t.model, "device": t.device, "endpoint": t.endpoint},
        "symptom": symptom,
        "configs": session.configs,
        "candidate_topk": route.live_k,
        "suspects": [{k: v for k, v in s.items() if k != "decision_evidence"} for s in suspects],
        "fixes": [],
        "explained": None,
        "verdicts": _verdicts(
            session,
            symptom,
            root,
            NO_SIGNATURE,
            suspects,
            localization=loc,
            characterization=characterize_live(
                session, route, root, ref_records, live_records, failing, baseline
            ),
        ),
    }


def _dump(session: Session) -> dict:
    """The reference's recall, the dump's localization, every verdict decided once from the
    questions; the ``investigation.json`` content of a dump run."""
    route = DumpRoute(session)
    ref_records = session.measure("reference", session.reference) if session.loaded else []
    suspects = [decide_dump(m) for m in measure_suspects(session, route.measure_suspect)]
    loc = route.localize()
    ledger, t = session.ledger, session.ledger.target
    symptom = {
        **ledger.symptom.to_json(),
        "reference": session.reference.label(),
        "candidate": "engine tensor dump",
        "recall_reference": recall_by_length(ref_records),
        "recall_candidate": {},
        "cases": len(ref_records),
    }
    return {
        "route": "dump",
        "ledger": ledger.path.name,
        "target": {"model": t.model, "device": t.device, "dump": str(t.dump)},
        "symptom": symptom,
        "configs": session.configs,
        "candidate_topk": None,
        "suspects": suspects,
        "fixes": [],
        "explained": None,
        "verdicts": _verdicts(session, symptom, None, NO_SIGNATURE, suspects, localization=loc),
    }


def _verdicts(session: Session, symptom: dict, root, sig: dict, suspects: list[dict], **extra) -> dict:
    evidence = {s["id"]: session.state.evidence(s["id"]) for s in suspects}
    return build_verdicts(
        symptom=symptom,
        root=root,
        sig=sig,
        suspects=suspects,
        diffs=session.diffs,
        evidence=evidence,
        **extra,
    )


def _write(session: Session, investigation: dict) -> Findings:
    """Check ``investigation`` (and its verdicts) against their schemas, then write
    ``verdicts.json`` and ``investigation.json`` once each, with no absolute path of this machine."""
    investigation = relativize(investigation, session.path_map())
    validate_findings(investigation)
    verdicts = investigation["verdicts"]
    for s in verdicts["suspects"]:
        session.state.set_status(s["id"], s["verdict"], s["reason"])
    atomic_write_json(session.out / "verdicts.json", verdicts)
    atomic_write_json(session.out / "investigation.json", investigation)
    session.state.data = relativize(session.state.data, session.path_map())
    session.state.save()
    session.progress("verdicts", 1, 1, "")
    cand = session.records("candidate")
    return Findings(session.out, investigation, cand, session.state.data["ledger_sha256"])
