"""``run_investigation(ledger, out)``: cheap questions, then the symptom, then checks in tier
order, then the fixes, the signature and the verdicts, all resumable from ``out``.

Steps (each recorded in ``state.json`` as it finishes; see ``state.RunState``):

1. **questions**: every suspect's cheap questions, tier order; answers are evidence.
2. **symptom**: the reference and the candidate on the ledger's probe cases, in-process on the
   reference checkpoint (``measure.measure_case``); recall per length.
3. **checks**, tier order, per suspect: its audit checks (``needlescope.audit``) and its
   ablation (remove it from the candidate when present, else add it alone to the reference;
   paired on the same cases) plus the divergence of the final logits when added alone to the
   reference; then its verdict (``verdicts.suspect_verdict``).
4. **fixes**: each present suspect's removal, and the candidate at twice its ``index_topk``;
   each paired with the candidate.
5. **verdicts**: signature (``signature.signature``), root cause, fix labels;
   ``verdicts.json`` (``verdicts.VERDICTS_SCHEMA``) and ``investigation.json`` (everything
   the report needs, ``INVESTIGATION_KEYS``).

A ledger with ``candidate = "live"`` takes the live-endpoint route instead
(``investigate.measure.live``): no ablation is possible, each suspect's emulation in the reference is
compared with the live indexer capture. One with ``candidate = "dump"`` takes the dump route
(``investigate.measure.dump``): the localization comes from the engine's tensor dump compared with
the reference.
"""

from __future__ import annotations

from pathlib import Path

from needlescope.investigate.decide.causal import decide, symptom_loss
from needlescope.investigate.decide.signature import NO_SIGNATURE, signature
from needlescope.investigate.decide.verdicts import classify_fix, root_causes
from needlescope.investigate.ledger.ledger import load_ledger, with_chunk
from needlescope.investigate.measure.dump import DumpInvestigation
from needlescope.investigate.measure.inprocess import (
    CANDIDATE_ONLY,
    Progress,
    _explained_case,
    _explained_record,
    _Investigation,
    _symptom,
    _unexplained,
    check_suspects,
    replay_fixes,
)
from needlescope.investigate.measure.live import LiveInvestigation
from needlescope.investigate.measure.rank_paths import failing_rank_paths
from needlescope.investigate.report.artifacts import relativize, write_verdicts
from needlescope.paths import atomic_write_json

__all__ = ["run_investigation"]


def run_investigation(
    ledger_path: str | Path,
    out: str | Path,
    progress: Progress = lambda *a: None,
    *,
    loaded=None,
    allow_outside: bool = False,
    prefill_chunk: int | None = None,
) -> Path:
    """Run (or resume) the investigation of ``ledger_path`` into ``out``; returns verdicts.json's path.

    ``loaded``: an already loaded (model, tokenizer) of the ledger's checkpoint, to reuse it.
    A ledger whose candidate is ``live`` takes the live-endpoint route (``investigate.measure.live``),
    one whose candidate is ``dump`` the dump route (``investigate.measure.dump``).
    ``allow_outside``: accept ledger paths outside its folder (``--allow-outside``).
    ``prefill_chunk``: overrides the ledger's ``[target] prefill_chunk`` (``--prefill-chunk``)."""
    ledger = with_chunk(load_ledger(ledger_path, allow_outside=allow_outside), prefill_chunk)
    if ledger.target.live:
        return LiveInvestigation(ledger, Path(out), progress).run(loaded)
    if ledger.target.dump is not None:
        return DumpInvestigation(ledger, Path(out), progress).run(loaded)
    inv = _Investigation(ledger, Path(out), progress)
    if not inv.state.is_done("questions"):
        inv.questions()
        inv.state.mark_done("questions")
    inv.load(loaded)
    ref_records = cand_records = fixes = topk_runs = []
    explained = probe_case = None
    if inv.model is not None:
        ref_records = inv.measure("reference", inv.reference)
        cand_records = inv.measure("candidate", inv.candidate)
        case_id, why = _explained_case(ref_records, cand_records)
        probe_case = next(
            (c for c in inv.cases if c.case_id == case_id), max(inv.cases, key=lambda c: c.length)
        )
        explained = {"case_id": case_id, "why": why}
    suspects_out = check_suspects(
        inv, inv.suspects, lambda s: inv.check_suspect(s, ref_records, cand_records, probe_case)
    )
    if inv.model is not None:
        fixes, topk_runs = replay_fixes(inv, inv.suspects, suspects_out, cand_records, explained)
    sig = signature(cand_records, topk_runs) if cand_records else NO_SIGNATURE
    decided = decide(suspects_out, symptom_loss(ref_records, cand_records), sig["uninformative_ranking"])
    root = decided["root_cause"]
    for f in fixes:
        f["label_kind"] = classify_fix(
            f["pair"],
            removes=f["removes"],
            root_cause=root_causes(suspects_out) or root,
            keeps_topk=f["keeps_topk"],
        )
    extra = {
        "multiplicity": decided["multiplicity"],
        **_unexplained(inv, suspects_out, ref_records, cand_records),
        "rank_paths": failing_rank_paths(inv, explained, CANDIDATE_ONLY, cand_records),
    }
    symptom = _symptom(inv, ref_records, cand_records)
    verdicts = write_verdicts(inv, symptom, root, sig, suspects_out, **extra)
    atomic_write_json(
        inv.out / "investigation.json",
        relativize(
            {
                "route": "in-process",
                "ledger": ledger.path.name,
                "target": {"model": ledger.target.model, "device": ledger.target.device},
                "symptom": symptom,
                "configs": inv.configs,
                "candidate_topk": cand_records[0]["index_topk"] if cand_records else None,
                "suspects": [{k: v for k, v in s.items() if k != "inputs"} for s in suspects_out],
                "fixes": fixes,
                "explained": _explained_record(explained, ref_records, cand_records),
                "verdicts": verdicts,
            },
            inv.path_map(),
        ),
    )
    inv.state.data = relativize(inv.state.data, inv.path_map())
    inv.state.save()
    progress("verdicts", 1, 1, "")
    return inv.out / "verdicts.json"
