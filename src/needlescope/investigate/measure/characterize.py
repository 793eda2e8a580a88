"""The measurements ``decide.characterize`` reads, with their discriminating experiments (both
routes); the classes are decided in ``decide.decision``, never here, and ``state.json`` caches
these measurements (``STEP``), never a result.

``measure_characterization_inprocess(session, ...)`` runs when ``decide`` says recall is lost and
no ledger suspect explains it (no root cause, or only automatic ones: differences the ledger did
not name). The **target** is
what is left to explain (the candidate when an automatic suspect is the root cause, else the
residual candidate), the **baseline** what it is compared with (the candidate without those
automatic suspects; else the reference at the target's ``index_topk``). It measures:

* **cells**: paired outcomes per length, the symptom's own plus two cheap experiments, each on
  the reference and the target: a **dense length** (``ratio x index_topk`` tokens, one less when
  that shares the failing length's residue mod ratio: every entry is selected, so a loss there is
  outside the selection), and the **residue lengths** L+1 ..
  L+ratio-1 around the shortest failing length L (one trial per depth);
* **selections**: for up to ``FAILING_CASES`` failing cases (wrong under the target, right under
  the reference; shortest first), every CSA layer's selection of the target and of the baseline
  at the analysed query, teacher-forced and decoded (``rank_paths.path_selections``);
* **where**: ``decide`` adds the localizer's first divergent module on each path (the measured
  ``localization``).

Budget: ``2 x (1 + ratio - 1)`` short batches plus two prompt passes per failing case, about
what the fixes step costs; the example ledger (a named root cause) runs none of it, so
``make demo`` keeps its time. Records resume from ``measure/char-*.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import TYPE_CHECKING

from needlescope.errors import BadInput
from needlescope.investigate.decide.characterize import Context, Evidence, LengthCell
from needlescope.investigate.decide.measured import CharacterizationInput
from needlescope.investigate.decide.selection_evidence import Row, layer_selection
from needlescope.investigate.decide.verdicts import paired
from needlescope.investigate.ledger.differences import AUTO_PREFIX
from needlescope.investigate.ledger.plan import Config, at_topk

if TYPE_CHECKING:
    from needlescope.investigate.measure.session import Session

__all__ = ["FAILING_CASES", "STEP", "measure_characterization_inprocess", "measure_characterization_live"]

STEP = "measured:characterization"
"""The ``state.json`` step that caches the characterization's measurements (never its result)."""

FAILING_CASES = 2
DENSE_CASES = 6
"""Cases at the dense length: enough for an exact McNemar p < 0.05 when every one is lost
(6 losses, none gained: p = 1/64); the short prompts make them cheap."""


def _ok(records: list[dict]) -> dict[str, bool]:
    return {r["case_id"]: r["correct"] for r in records if not r.get("error")}


def _cells(records_by_length: dict[int, tuple[list, list]], ratio: int) -> list[LengthCell]:
    cells = []
    for length, (ref, tgt) in sorted(records_by_length.items()):
        p = paired(_ok(tgt), _ok(ref))
        cells.append(LengthCell(length, p["n"], p["b"], p["c"], length // ratio))
    return cells


def _by_length(ref: list[dict], tgt: list[dict], into: dict) -> None:
    for r in ref:
        into.setdefault(r["length"], ([], []))[0].append(r)
    for r in tgt:
        into.setdefault(r["length"], ([], []))[1].append(r)


def _extra_cases(session: Session, lengths: list[int], trials: int = 1) -> list:
    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.checkpoint import trained_value_digits
    from needlescope.dsa.prompt import render_prompt

    sy = session.ledger.symptom
    spec = CaseSpec(
        kind=sy.kind,
        lengths=lengths[:1],
        depths=sy.depths,
        trials=trials,
        seed=sy.seed,
        value_digits=trained_value_digits(session.model_dir),
    )
    count = lambda m: len(render_prompt(session.tokenizer, m).input_ids)  # noqa: E731
    cases = []
    for length in lengths:  # a dense length too short for the needle and question is left out
        try:
            cases += build_cases(replace(spec, lengths=[length]), count)
        except BadInput:
            continue
    for c in cases:
        session.prompt_len[c.case_id] = len(render_prompt(session.tokenizer, c.messages).input_ids)
    return cases


def _discriminating_cases(session: Session, dense: int, shortest: int, failing: int, ratio: int) -> list:
    """The dense length's cases (``DENSE_CASES`` at least; none when the symptom already has a
    dense length) and one per depth at each residue length around the shortest failing one.
    The dense length is moved one token down (still dense) when it shares the failing length's
    residue mod ``ratio``: a loss there must not be a boundary bug's, read as outside_selection."""
    depths = len(session.ledger.symptom.depths)
    if dense % ratio == failing % ratio:
        dense -= 1
    cases = _extra_cases(session, [dense], -(-DENSE_CASES // depths)) if dense < shortest else []
    return cases + _extra_cases(session, [failing + d for d in range(1, ratio)])


def _selection_layers(session: Session, target, baseline, failing: list[dict]) -> tuple[list, int]:
    """(``LayerSelection`` per (CSA layer, path) over the failing cases' analysed queries, the
    failing cases left out because their rerun alone did not reproduce the recorded token on
    either path). A failure that depends on what ran before the case (a cache slot kept across
    requests, the batch) answers right here: its selections equal the reference's while the
    answers "differ", which read as outside_selection for a bug inside the selection."""
    from needlescope.dsa.prompt import covering_entries, needle_token_span, render_prompt
    from needlescope.dsa.reference import visible_entries
    from needlescope.investigate.measure.rank_paths import path_selections

    rows: dict[tuple[int, str], list[Row]] = {}
    not_reproduced = 0
    for rec in failing:
        case = next(c for c in session.cases if c.case_id == rec["case_id"])
        prompt = render_prompt(session.tokenizer, case.messages)
        a, ratio = rec["analysed_token"], rec["compress_ratio"]
        answer, query = rec["output_ids"][:a], len(prompt.input_ids) - 1 + a
        said: dict[str, int] = {}
        tgt = path_selections(
            session.model, target, prompt.input_ids, answer, query, chunk=session.chunk, tokens=said
        )
        if a < len(rec["output_ids"]) and rec["output_ids"][a] not in said.values():
            not_reproduced += 1  # (past the recorded ids, the token is EOS or unknown: kept)
            continue
        base = path_selections(session.model, baseline, prompt.input_ids, answer, query, chunk=session.chunk)
        visible = int(visible_entries(query, ratio))
        spans = covering_entries(needle_token_span(prompt, case.needle), ratio=ratio, overlap=True)
        needle = frozenset(e for e in spans if e < visible)
        for path, layers in tgt.items():
            for layer, (selected, _) in layers.items():
                ref_sel = frozenset(base[path][layer][0])
                rows.setdefault((layer, path), []).append(Row(frozenset(selected), ref_sel, visible, needle))
    return [layer_selection(layer, path, r) for (layer, path), r in sorted(rows.items())], not_reproduced


def measure_characterization_inprocess(
    session: Session, suspects: list[dict], ref_records, cand_records
) -> CharacterizationInput:
    """The in-process characterization's measurements (module docstring), resumed from
    ``state.json``; ``decide`` asked for them (``decision.characterization_needed``) and
    decides the classes from them."""
    from needlescope.investigate.measure.causal import residual_config

    done = session.state.step_value(STEP)
    if done is not None:
        return CharacterizationInput.from_json(done)
    implicated = [s for s in suspects if s["verdict"] == "implicated" and s["present"]]
    by_id = {s.id: s for s in session.suspects}
    autos = [by_id[s["id"]] for s in implicated if s["id"].startswith(AUTO_PREFIX)]
    target = session.candidate if autos else residual_config(session, [by_id[s["id"]] for s in implicated])
    baseline = residual_config(session, autos) if autos else _same_numerics(session, target)
    tgt_records = cand_records if autos or not implicated else session.measure("residual", target)
    k = cand_records[0]["index_topk"]
    ratio = cand_records[0]["compress_ratio"]
    failing_ok = _ok(ref_records)
    failing = sorted(
        (r for r in tgt_records if not r.get("error") and not r["correct"] and failing_ok.get(r["case_id"])),
        key=lambda r: (r["length"], r["depth"], r["trial"]),
    )
    by_length: dict = {}
    _by_length(ref_records, tgt_records, by_length)
    lengths = sorted({r["length"] for r in failing}) or sorted(by_length)
    cases = _discriminating_cases(session, ratio * k, min(by_length), lengths[0], ratio)
    session.progress("characterize", 0, 2, "dense and residue lengths")
    _by_length(
        session.measure("char-reference", session.reference, cases),
        session.measure("char-target", target, cases),
        by_length,
    )
    session.progress("characterize", 1, 2, "selections of the failing cases")
    layers, not_reproduced = _selection_layers(session, target, baseline, failing[:FAILING_CASES])
    ev = Evidence(
        recall_lost=True,
        cells=tuple(_cells(by_length, ratio)),
        layers=tuple(layers),
        answers_differ=len(failing[:FAILING_CASES]) > not_reproduced,
        not_reproduced=not_reproduced,
        rerun=len(failing[:FAILING_CASES]),
    )
    ids_file, _, _ = _case_files(session, failing)
    ctx = Context(
        route="in-process",
        ratio=ratio,
        topk=k,
        model=session.ledger.target.model,
        candidate_flags=_flags(target),
        sweep_flags=_sweep_flags(target),
        input_ids=ids_file,
        lengths=tuple(lengths),
        device=session.ledger.target.device,
    )
    out = CharacterizationInput(ev, ctx, baseline.label())
    session.state.mark_done(STEP, out.to_json())
    session.progress("characterize", 2, 2, "")
    return out


def _same_numerics(session: Session, target):
    """The target's numerics and top-k without its patches (what its configured precision
    explains), or the reference at its top-k when the target carries no patch."""
    plain = Config(target.setting.with_(patch=None), ())
    k = target.setting.index_topk
    return plain if plain.label() != target.label() else at_topk(session.reference, k)


def _sweep_flags(cfg) -> tuple[str, ...] | None:
    """The target's setting as ``indexer sweep`` flags, or None when it carries more than one
    patch (the sweep takes one ``--patch``)."""
    s = cfg.setting
    patches = ([_spec(s.patch)] if s.patch is not None else []) + [_spec(p) for p in cfg.extra]
    if len(patches) > 1:
        return None
    flags = ["--index-k", s.index_k, "--index-q", s.index_q, "--score-dtype", s.score_dtype]
    return tuple(flags + [f for p in patches for f in ("--patch", p)])


def _flags(cfg) -> tuple[str, ...]:
    """The target's setting as ``needlescope indexer`` flags (its patches quoted as given)."""
    s = cfg.setting
    flags = ["--index-k", s.index_k, "--index-q", s.index_q, "--score-dtype", s.score_dtype]
    if s.patch is not None:
        flags += ["--patch", _spec(s.patch)]
    for p in cfg.extra:
        flags += ["--extra-patch", _spec(p)]
    return tuple(flags)


def _spec(patch) -> str:
    """A patch as a ``next`` command names it: ``fault:NAME``, or its file's absolute path."""
    return patch.spec if patch.is_fault else str(patch.path.resolve())


def _live_layers(route, ratio: int, failing: list[dict], baseline: dict) -> list:
    """``LayerSelection`` per (CSA layer, path) of the live selection against the reference's at
    the live ``index_topk`` run the server's way: the first compared row of a case is the
    server's prefill, the later ones its decode steps."""
    rows: dict[tuple[int, str], list[Row]] = {}
    for rec in failing:
        needle = route.needle_entries(rec)
        first = rec["prompt_tokens"] - 1
        for layer, live_rows in rec["rows"].items():
            base_rows = baseline[rec["case_id"]][layer]
            for i, (live, base) in enumerate(zip(live_rows, base_rows)):
                visible = (first + i + 1) // ratio
                ne = frozenset(e for e in needle.get(layer, []) if e < visible)
                path = "prefill" if i == 0 else "decode"
                rows.setdefault((int(layer), path), []).append(
                    Row(frozenset(live), frozenset(base), visible, ne)
                )
    return [layer_selection(layer, path, r) for (layer, path), r in sorted(rows.items())]


def _case_files(session: Session, failing: list[dict]) -> tuple[str | None, str | None, str | None]:
    """(ids file, messages file, needle) of the first failing case, written under the run
    directory for the ``next`` command (absolute paths: it runs as printed from anywhere): the
    ids are the prompt and the answer tokens before the analysed one, as ``indexer diff
    --input-ids`` reads them; the messages file is what ``indexer capture --prompt`` reads."""
    from needlescope.dsa.prompt import needle_token_span, render_prompt
    from needlescope.paths import atomic_write_json

    if not failing:
        return None, None, None
    rec = failing[0]
    case = next(c for c in session.cases if c.case_id == rec["case_id"])
    prompt = render_prompt(session.tokenizer, case.messages)
    ids = prompt.input_ids + list(rec.get("output_ids", []))[: rec.get("analysed_token", 0)]
    folder = (session.out / "characterize").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    span = needle_token_span(prompt, case.needle)
    atomic_write_json(folder / "input_ids.json", {"input_ids": ids, "needle_token_span": list(span)})
    atomic_write_json(folder / "prompt.json", case.messages)
    return str(folder / "input_ids.json"), str(folder / "prompt.json"), case.needle


def _csa(model):
    from needlescope.dsa.emulate import csa_indexers

    return csa_indexers(model)


def measure_characterization_live(
    session: Session, route, ref_records, live_records, failing, baseline
) -> CharacterizationInput:
    """The live characterization's measurements (``route``: the ``measure.live.LiveRoute`` that
    calls it, left unannotated: live imports this module): the dense and residue lengths probed live and
    on the reference (``route.probe_live(name, cases)``), and the live selections of the failing
    cases compared with the reference's on both the server's prefill and decode rows. Resumed
    from ``state.json`` only when every case answered (a rerun that gets more answers measures
    again, so it decides as an uninterrupted run would)."""
    scored = [r for r in live_records if not r.get("error")]
    basis = _live_basis(route.live_k, scored, failing)
    done = session.state.step_value(STEP)
    if isinstance(done, dict) and done.get("basis") == basis and "value" in done:
        return CharacterizationInput.from_json(done["value"])
    k, ratio = route.live_k, int(_csa(session.model)[0][1].compress_rate)
    by_length: dict = {}
    _by_length(ref_records, scored, by_length)
    lengths = sorted({r["length"] for r in failing}) or sorted(by_length)
    cases = _discriminating_cases(session, ratio * k, min(by_length), lengths[0], ratio)
    session.progress("characterize", 0, 2, "dense and residue lengths, live and reference")
    live_extra = [r for r in route.probe_live("char-live", cases) if not r.get("error")]
    _by_length(session.measure("char-reference", session.reference, cases), live_extra, by_length)
    session.progress("characterize", 1, 2, "the failing cases' live selections")
    ev = Evidence(
        recall_lost=True,
        cells=tuple(_cells(by_length, ratio)),
        layers=tuple(_live_layers(route, ratio, failing, baseline.get("decode", {}))),
        answers_differ=bool(failing),
    )
    _, prompt_file, needle = _case_files(session, failing)
    ctx = Context(
        route="live",
        ratio=ratio,
        topk=k,
        model=session.ledger.target.model,
        base_url=session.ledger.target.endpoint,
        prompt=prompt_file,
        needle=needle,
        served_model=str(session.state.server_info.get("model") or "organism"),
        lengths=tuple(lengths),
        device=session.ledger.target.device,
    )
    out = CharacterizationInput(ev, ctx, f"reference at the live index_topk {k}")
    if len(live_extra) == len(cases) and len(scored) == len(session.cases):
        # complete: every case answered; otherwise the next run sends what failed again
        session.state.mark_done(STEP, {"basis": basis, "value": out.to_json()})
    session.progress("characterize", 2, 2, "")
    return out


def _live_basis(live_k, scored: list[dict], failing: list[dict]) -> str:
    """Digest of what a live characterization rests on: the live top-k, the answered cases and
    the failing cases' records (their answers and captures)."""
    answered = sorted(r["case_id"] for r in scored)
    blob = json.dumps([live_k, answered, failing], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
