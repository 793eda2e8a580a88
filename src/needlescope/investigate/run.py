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
5. **what the decisions leave unexplained**: the residual (the candidate without the implicated
   suspects), the localizer step, the characterization's experiments and the rank paths, each
   when ``decide.decision``'s rules ask for it;
6. **verdicts**: ``decide.decision.decide(measured, ledger) -> Findings`` decides every verdict,
   role and label once, from the route's ``Measured``; ``verdicts.json``
   (``schema.VERDICTS_SCHEMA``) and ``investigation.json`` (``Findings.to_json()``,
   ``schema.INVESTIGATION_SCHEMA``) are written once each.

A route is a module of ``investigate/measure/`` with ``measure(session) -> Measured``
(``ROUTES``; the protocol is ``decide.measured``). A ledger with ``candidate = "live"`` takes the
live-endpoint route (``measure.live``): no ablation is possible, each suspect's emulation in the
reference is compared with the live indexer capture. One with ``candidate = "blackbox"`` takes the black-box route (``measure.blackbox``): an endpoint
without a capture, characterized from its answers alone. One with ``candidate = "dump"`` takes the
dump route (``measure.dump``): the localization comes from the engine's tensor dump compared
with the reference. Every other ledger takes the in-process route (``measure.inprocess``).
"""

from __future__ import annotations

from pathlib import Path

from needlescope.investigate.decide.decision import decide
from needlescope.investigate.decide.findings import Findings
from needlescope.investigate.ledger.ledger import Ledger, load_ledger, with_chunk
from needlescope.investigate.measure import blackbox, dump, inprocess, live
from needlescope.investigate.measure.session import Session
from needlescope.investigate.measure.state import run_lock
from needlescope.paths import atomic_write_json, relativize
from needlescope.progress import Progress, no_progress

__all__ = ["run_investigation", "ROUTES", "route_of"]

ROUTES = {
    "in-process": inprocess.measure,
    "live": live.measure,
    "dump": dump.measure,
    "blackbox": blackbox.measure,
}
"""route name -> its ``measure(session) -> Measured`` (a new route adds itself here and to
``route_of``, and its decision to ``decide.decision.SUSPECT_RULES``)."""


def route_of(ledger: Ledger) -> str:
    """The route a ledger takes: "blackbox" for ``candidate = "blackbox"``, "live" for
    ``candidate = "live"``, "dump" for ``candidate = "dump"``, else "in-process"."""
    if ledger.target.blackbox:
        return "blackbox"
    if ledger.target.live:
        return "live"
    return "dump" if ledger.target.dump is not None else "in-process"


def run_investigation(
    ledger_path: str | Path | Ledger,
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

    ``ledger_path``: the ledger's file, or the ``Ledger`` already parsed from it (parsed once).

    ``loaded``: an already loaded (model, tokenizer) of the ledger's checkpoint, to reuse it.
    ``allow_outside``: accept ledger paths outside its folder (``--allow-outside``).
    ``prefill_chunk``: overrides the ledger's ``[target] prefill_chunk`` (``--prefill-chunk``).
    ``api_key``: the live endpoint's bearer key (``--api-key``; never in the ledger or the run).
    ``serving_factors``: a live run that loses recall measures which serving factor reproduces
    it (``--serving-factors``; ``measure.serving_factors``, decided by ``decide.serving_factor``)."""
    parsed = (
        ledger_path
        if isinstance(ledger_path, Ledger)
        else load_ledger(ledger_path, allow_outside=allow_outside)
    )
    ledger = with_chunk(parsed, prefill_chunk)
    with run_lock(Path(out)):  # one run at a time writes a run directory
        session = Session(ledger, Path(out), progress, api_key=api_key, serving_factors=serving_factors)
        session.questions()
        route = route_of(ledger)
        if route != "blackbox":  # the black box loads no model: it reads the endpoint's answers
            session.load(loaded)
        measured = ROUTES[route](session)
        return _write(session, decide(measured, ledger))


def _write(session: Session, findings: Findings) -> Findings:
    """Write ``verdicts.json`` and ``investigation.json`` once each (checked against their
    schemas by ``Findings.to_json``), with no absolute path of this machine; the findings as
    written, with the run directory and the candidate's records."""
    obj = relativize(findings.to_json(), session.path_map())
    atomic_write_json(session.out / "verdicts.json", obj["verdicts"])
    atomic_write_json(session.out / "investigation.json", obj)
    session.state.relativize(session.path_map())
    session.progress("verdicts", 1, 1, "")
    return Findings.from_json(
        obj,
        out=session.out,
        candidate_records=session.records("candidate"),
        ledger_sha256=session.state.ledger_sha256,
    )
