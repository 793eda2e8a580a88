"""One probe run end to end: preflight, exact-length cases, durable results, analysis, outputs.

Every input is validated, the target checked and every case built before anything is written, so a
bad flag or an unreachable server never leaves a half-made run behind. The library reports progress
through ``on_event(name, payload)`` and never prints; the CLI renders it.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import replace
from pathlib import Path

from needlescope.analysis import cells_from_results
from needlescope.analysis.endpoints import check_same_models, endpoint_breakdown
from needlescope.analysis.margins import group_margins
from needlescope.analysis.probe_summary import analyze_probe, length_notes, reached_length
from needlescope.analysis.taxonomy import CaseIndex, classify, summarize_failures
from needlescope.cases import CaseSpec, build_cases, order_for_prefix_cache, score_answer
from needlescope.cases.needles import VALUE_DIGITS
from needlescope.errors import BadInput, ProbeError
from needlescope.progress import Event, Progress
from needlescope.report.probe import write_probe_outputs
from needlescope.run.bundles import write_failure_bundles
from needlescope.run.config import ProbeConfig
from needlescope.run.scheduler import Grade, run_cases
from needlescope.run.store import ResultStore, create_store, peek
from needlescope.targets import (
    ChatTarget,
    LocalTokenCounter,
    collect_provenance,
    detect_server_tokenizer,
    normalize_base_url,
    preflight,
    served_models,
)
from needlescope.targets.limits import TargetLimits, choose_value_digits, fit_lengths, read_limits
from needlescope.targets.logprobs import detect_method, score_gold

STORE_NAME = "results.sqlite"


def _noop(_name: str, _payload: dict) -> None:
    return None


def progress_events(on_event: Event) -> Progress:
    """A ``needlescope.progress`` callback that reports through ``on_event("progress", ...)``."""

    def progress(task: str, done: int, total: int | None, detail: str = "") -> None:
        on_event("progress", {"task": task, "done": done, "total": total, "detail": detail})

    return progress


def _token_counter(cfg: ProbeConfig, root: str):
    if cfg.tokenizer == "server":
        counter = detect_server_tokenizer(root, cfg.model, api_key=cfg.api_key)
        if counter is None:
            raise BadInput(
                f"the server at {root} exposes no /tokenize endpoint; pass --tokenizer PATH to the "
                "checkpoint's tokenizer directory (tokenizer.json + chat_template.jinja)"
            )
        return counter
    return LocalTokenCounter(cfg.tokenizer, cfg.chat_template)


def check_out(out: Path, resume: bool) -> None:
    """BadInput, before any request, when ``out`` cannot hold this run; creates nothing."""
    store = out / STORE_NAME
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is a file, not a folder; choose another --out")
    if resume and not store.is_file():
        raise BadInput(
            f"--resume: {out} holds no run to continue (no {STORE_NAME}); drop --resume to start one"
        )
    if not resume and store.exists():
        # --force never replaces it: a run's results are never deleted by a flag.
        raise BadInput(
            f"{store} already holds a run; pass --resume to continue it or choose another --out "
            "(--force does not replace a run's results: move the folder away to start over)"
        )
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(
            f"--out {out}: {existing} is a file, so the folder cannot be made; choose another --out"
        )
    try:
        # Permission bits lie to root and on read-only mounts; a real (self-deleting) file does not.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise BadInput(
            f"--out {out} is not writable ({e.strerror} in {existing}); choose another --out"
        ) from None


def fit_to_target(cfg: ProbeConfig, limits: TargetLimits, on_event: Event = _noop) -> ProbeConfig:
    """``cfg`` with only the lengths the target can hold (``targets.limits.fit_lengths``: BadInput
    when one does not fit, unless ``--skip-long-lengths``, which drops it with an event)."""
    kept, dropped = fit_lengths(cfg.lengths, limits, answer_tokens=cfg.max_tokens, skip=cfg.skip_long_lengths)
    if dropped:
        on_event(
            "lengths_skipped",
            {
                "skipped": list(dropped),
                "kept": list(kept),
                "context": limits.context,
                "from": limits.context_from,
            },
        )
    return replace(cfg, lengths=kept)


def _read_haystack(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"--haystack-file {path} is not UTF-8 text (byte {e.start}); pass a UTF-8 text file"
        ) from None
    except OSError as e:
        raise BadInput(f"--haystack-file {path} cannot be read ({e.strerror})") from None


def _new_store(
    cfg: ProbeConfig, root: str, provenance: dict, limits: TargetLimits, assumed: list[str], on_event: Event
) -> ResultStore:
    digits, source = choose_value_digits(cfg.value_digits, limits)
    haystack = _read_haystack(cfg.haystack_file) if cfg.haystack_file else None
    spec = CaseSpec(
        kind=cfg.kind,
        lengths=cfg.lengths,
        depths=cfg.depths,
        trials=cfg.trials,
        seed=cfg.seed,
        haystack_text=haystack,
        max_answer_tokens=cfg.max_tokens,
        value_digits=digits,
        n_distractors=cfg.distractors,
    )
    counter = _token_counter(cfg, root)
    try:
        built = build_cases(spec, counter, progress_events(on_event))
    except ProbeError as e:
        # The target failed (or died) while counting the prompts: before anything was written, so
        # the run is not started, as when its preflight fails (one line, exit 2, no traceback).
        raise BadInput(
            f"the target failed while counting the cases' tokens, before any case was sent: {e}; "
            "nothing was written: rerun when the server answers"
        ) from None
    finally:
        if hasattr(counter, "close"):
            counter.close()
    cases = order_for_prefix_cache(built)
    on_event("value_digits", {"value_digits": digits, "source": source})
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / STORE_NAME
    if path.exists() and peek(path)["fingerprint"] is not None:
        # Another run made it between check_out and here (and has ended: it held the lock).
        raise BadInput(f"{path} already holds a run; pass --resume to continue it or choose another --out")
    meta = {
        "fingerprint": cfg.fingerprint(digits),
        "provenance": provenance,
        "run_notes": {"value_digits_source": source, "assumed": assumed},
    }
    return create_store(path, meta, [c.to_dict() for c in cases])


def _resume_store(cfg: ProbeConfig, on_event: Event) -> ResultStore:
    """The store to resume, checked read-only first (a foreign file is never written to)."""
    path = cfg.out / STORE_NAME
    if not path.is_file():
        raise BadInput(f"--resume: {path} does not exist; drop --resume to start a run there")
    found = peek(path)
    previous = found["fingerprint"]
    digits = cfg.value_digits if cfg.value_digits is not None else (previous or {}).get("value_digits")
    source = (found["run_notes"] or {}).get("value_digits_source", "--value-digits")
    if previous is None or not found["cases"]:
        raise BadInput(f"--resume: {path} holds no cases; delete it and start the run again")
    if previous != cfg.fingerprint(digits):
        raise BadInput(
            f"--resume: the run in {cfg.out} was made with {previous}, not {cfg.fingerprint(digits)}; use another --out"
        )
    # A store made for this run and not yet sent (compare's side B) is not "being resumed".
    said = f"the run being resumed ({source})" if found["results"] else source
    on_event("value_digits", {"value_digits": digits, "source": said})
    return ResultStore(path)


def run_probe(
    cfg: ProbeConfig, on_event: Event = _noop, *, difficulty: dict | None = None, flag: str = "--base-url"
) -> dict:
    """Run the probe described by ``cfg`` and return the summary dict written to summary.json.

    ``difficulty``: the auto-difficulty search that chose ``cfg``'s difficulty (run.difficulty),
    kept with the run and written to its summary. ``flag``: the option that named the server,
    for the preflight's message (compare's ``--a``/``--b``; a side may die after compare's own
    preflight)."""
    roots = [normalize_base_url(u) for u in cfg.base_urls]
    check_out(cfg.out, cfg.resume)
    # The test chat may be a cold server's first request (CPU warm-up); allow it more than 5 s.
    wait = min(cfg.timeout_s, 30.0)
    assumed = [
        n
        for root, _v1 in roots
        for n in preflight(root, cfg.model, api_key=cfg.api_key, timeout=wait, flag=flag)
    ]
    if len(roots) > 1:
        listed = {root: served_models(root, cfg.api_key) for root, _v1 in roots}
        check_same_models({root: ids for root, ids in listed.items() if ids is not None})
    provenance = collect_provenance(*roots[0], api_key=cfg.api_key, timeout=min(cfg.timeout_s, 5.0))
    limits = read_limits(provenance, cfg.model)
    cfg = fit_to_target(cfg, limits, on_event)
    if cfg.resume:
        store = _resume_store(cfg, on_event)
    else:
        store = _new_store(cfg, roots[0][0], provenance, limits, assumed, on_event)
    try:
        if difficulty is not None:
            store.put_meta("difficulty", difficulty)
        case_dicts = store.cases()
        pending = set(store.pending_case_ids())
        on_event("run_start", {"total": len(case_dicts), "todo": len(pending)})
        admission = asyncio.run(_run(cfg, case_dicts, pending, store, on_event))
        summary = _finish(cfg, store, case_dicts, admission)
    finally:
        store.close()
    on_event("run_end", {"out": str(cfg.out)})  # every output of this run is written
    return summary


def chat_target(cfg: ProbeConfig) -> ChatTarget:
    """The client a probe (or a bisection) of ``cfg`` sends its cases through."""
    return ChatTarget(
        list(cfg.base_urls),
        cfg.model,
        api_key=cfg.api_key,
        timeout=cfg.timeout_s,
        retries=cfg.retries,
        retry_budget_s=cfg.retry_budget_s,
        concurrency=cfg.concurrency,
    )


def _template_kwargs(cfg: ProbeConfig) -> dict | None:
    """The chat-template arguments the chats carry, so the scored prompt is the chatted one."""
    kwargs = cfg.extra_body.get("chat_template_kwargs")
    return kwargs if isinstance(kwargs, dict) else None


async def _grader(cfg: ProbeConfig, target: ChatTarget, store: ResultStore, on_event: Event) -> Grade | None:
    """Detect how this server scores gold answers (``--graded``), record it; None when it cannot."""
    if not cfg.graded:
        return None
    kwargs = _template_kwargs(cfg)
    method = await detect_method(target, cfg.top_logprobs, kwargs)
    store.put_meta("graded", method.to_dict())
    on_event("graded", method.to_dict())
    if method.method is None:
        return None

    async def grade(case: dict) -> dict:
        return await score_gold(target, method, case["messages"], case["expected"], template_kwargs=kwargs)

    return grade


async def _run(
    cfg: ProbeConfig, case_dicts: list[dict], pending: set[str], store: ResultStore, on_event: Event
) -> dict:
    target = chat_target(cfg)
    try:
        grade = await _grader(cfg, target, store, on_event)
        ungraded = set(store.pending_graded_ids()) if grade is not None else set()
        todo = pending | ungraded
        await run_cases(
            [c for c in case_dicts if c["case_id"] in todo],
            target,
            store,
            concurrency=cfg.concurrency,
            max_tokens=cfg.max_tokens,
            extra_body=cfg.extra_body,
            score=score_answer,
            on_result=lambda row: on_event("result", row),
            chat_ids=pending,
            grade=grade,
            grade_ids=ungraded,
        )
    finally:
        await target.aclose()
    return {"rejections": target.rejections, "lowest_concurrency": target.gate.lowest}


def _finish(cfg: ProbeConfig, store: ResultStore, case_dicts: list[dict], admission: dict) -> dict:
    by_id = {c["case_id"]: c for c in case_dicts}
    run_notes = store.get_meta("run_notes") or {}
    fingerprint = store.get_meta("fingerprint") or {}
    rows = []
    notes = list(run_notes.get("assumed", []))
    if admission["rejections"]:
        notes.append(
            f"the server rejected {admission['rejections']} request(s) as busy (429/503); they were retried "
            f"and concurrency adapted down to {admission['lowest_concurrency']} at its lowest"
        )
    for r in store.results():
        case = by_id[r["case_id"]]
        row = {
            **r,
            "kind": case["kind"],
            "length": case["length"],
            "depth": case["depth"],
            "trial": case["trial"],
            "counted_length": case["counted_length"],
            "expected": case["expected"],
        }
        rows.append(row)
    notes += length_notes(rows)
    _classify_misses(rows, by_id)
    graded = _graded_section(cfg, store, rows)
    # A case that missed its length measures some other length: keep it out of the analysis.
    grid = [(c["length"], c["depth"]) for c in case_dicts]
    cells = cells_from_results((r for r in rows if reached_length(r)), grid)
    provenance = store.get_meta("provenance") or {}
    write_failure_bundles(
        cfg.out / "bundles",
        rows,
        by_id,
        model=cfg.model,
        max_tokens=cfg.max_tokens,
        extra_body=cfg.extra_body,
        generation={"seed": cfg.seed, "value_digits": fingerprint.get("value_digits", VALUE_DIGITS)},
        provenance=provenance,
        limit=cfg.bundles,
    )
    analysis = analyze_probe(
        cells=cells,
        results=rows,
        kind=cfg.kind,
        model=cfg.model,
        threshold=cfg.threshold,
        provenance=provenance,
        failures=summarize_failures(rows),
        endpoints=endpoint_breakdown(rows),
        value_digits=fingerprint.get("value_digits", VALUE_DIGITS),
        value_digits_source=run_notes.get("value_digits_source", "--value-digits"),
        graded=graded,
        difficulty=store.get_meta("difficulty"),
    )
    return write_probe_outputs(cfg.out, analysis, cells=cells, results=rows, notes=notes)


def _classify_misses(rows: list[dict], by_id: dict[str, dict]) -> None:
    """Attach each miss's failure class; an answer can be another case's value, so every row is
    indexed first (errored cases too: they were sent)."""
    index = CaseIndex(rows)
    for row in rows:
        if row["status"] == "ok" and not row.get("correct"):
            row["failure"] = classify(
                answer=row.get("answer"),
                expected=row["expected"],
                finish_reason=row.get("finish_reason"),
                reasoning=row.get("reasoning"),
                messages=by_id[row["case_id"]]["messages"],
                other_case=lambda value, row=row: index.source(row, value),
            ).to_dict()


def _graded_section(cfg: ProbeConfig, store: ResultStore, rows: list[dict]) -> dict | None:
    """Attach each case's graded row to its result row; the summary's ``graded`` part (None when
    this run never asked for it)."""
    meta = store.get_meta("graded")
    if meta is None:
        return None
    by_case = store.graded()
    scored = []
    for row in rows:
        g = by_case.get(row["case_id"])
        if g is None:
            continue
        row["graded"] = g
        if g["status"] == "ok" and reached_length(row):
            scored.append((row["length"], row["depth"], g))
    errors = sum(1 for g in by_case.values() if g["status"] == "error")
    return {
        **meta,
        "margin_threshold": cfg.margin_threshold,
        "scored": len(scored),
        "errors": errors,
        **group_margins(scored, cfg.margin_threshold),
    }
