"""One probe run end to end: preflight, exact-length cases, durable results, analysis, outputs.

The library reports progress through ``on_event(name, payload)`` and never prints; the CLI renders it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from needlescope.analysis import cells_from_results
from needlescope.analysis.endpoints import check_same_models, endpoint_breakdown
from needlescope.analysis.taxonomy import classify, summarize_failures
from needlescope.cases import CaseSpec, build_cases, order_for_prefix_cache, score_answer
from needlescope.errors import BadInput
from needlescope.report.probe import write_probe_outputs
from needlescope.run.config import ProbeConfig
from needlescope.run.replay import write_failure_bundles
from needlescope.run.scheduler import run_cases
from needlescope.run.store import ResultStore
from needlescope.targets import (
    ChatTarget,
    LocalTokenCounter,
    collect_provenance,
    detect_server_tokenizer,
    normalize_base_url,
    preflight,
)

Event = Callable[[str, dict], None]

STORE_NAME = "results.sqlite"


def _noop(_name: str, _payload: dict) -> None:
    return None


def _token_counter(cfg: ProbeConfig, root: str):
    if cfg.tokenizer == "server":
        counter = detect_server_tokenizer(root, cfg.model)
        if counter is None:
            raise BadInput(
                f"the server at {root} exposes no /tokenize endpoint; pass --tokenizer PATH to a tokenizer.json"
            )
        return counter
    path = Path(cfg.tokenizer)
    if not path.is_file():
        raise BadInput(f"--tokenizer {path} is not a file; pass 'server' or a path to an HF tokenizer.json")
    return LocalTokenCounter(path)


def _open_store(cfg: ProbeConfig) -> ResultStore:
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / STORE_NAME
    if path.exists() and not cfg.resume:
        raise BadInput(f"{path} already holds a run; pass --resume to continue it or choose another --out")
    store = ResultStore(path)
    previous = store.get_meta("fingerprint")
    if previous is not None and previous != cfg.fingerprint():
        store.close()
        raise BadInput(
            f"--resume: the run in {cfg.out} was made with {previous}, not {cfg.fingerprint()}; use another --out"
        )
    return store


def run_probe(cfg: ProbeConfig, on_event: Event = _noop) -> dict:
    """Run the probe described by ``cfg`` and return the summary dict written to summary.json."""
    roots = [normalize_base_url(u) for u in cfg.base_urls]
    served = {}
    for root, _v1 in roots:
        models = preflight(root, cfg.model, api_key=cfg.api_key)
        served[root] = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
    check_same_models(served)
    store = _open_store(cfg)
    try:
        if not store.cases():
            haystack = cfg.haystack_file.read_text(encoding="utf-8") if cfg.haystack_file else None
            spec = CaseSpec(
                kind=cfg.kind,
                lengths=cfg.lengths,
                depths=cfg.depths,
                trials=cfg.trials,
                seed=cfg.seed,
                haystack_text=haystack,
                max_answer_tokens=cfg.max_tokens,
                value_digits=cfg.value_digits,
            )
            on_event("cases_start", {"n": len(cfg.lengths) * len(cfg.depths) * cfg.trials})
            cases = order_for_prefix_cache(build_cases(spec, _token_counter(cfg, roots[0][0])))
            store.put_meta("fingerprint", cfg.fingerprint())
            store.put_meta("provenance", collect_provenance(*roots[0]))
            store.add_cases([c.to_dict() for c in cases])
        case_dicts = store.cases()
        pending = set(store.pending_case_ids())
        todo = [c for c in case_dicts if c["case_id"] in pending]
        on_event("run_start", {"total": len(case_dicts), "todo": len(todo)})
        asyncio.run(_run(cfg, todo, store, on_event))
        return _finish(cfg, store, case_dicts)
    finally:
        store.close()


async def _run(cfg: ProbeConfig, todo: list[dict], store: ResultStore, on_event: Event) -> None:
    target = ChatTarget(
        list(cfg.base_urls),
        cfg.model,
        api_key=cfg.api_key,
        timeout=cfg.timeout_s,
        retries=cfg.retries,
    )
    try:
        await run_cases(
            todo,
            target,
            store,
            concurrency=cfg.concurrency,
            max_tokens=cfg.max_tokens,
            extra_body=cfg.extra_body,
            score=score_answer,
            on_result=lambda row: on_event("result", row),
        )
    finally:
        await target.aclose()


def _finish(cfg: ProbeConfig, store: ResultStore, case_dicts: list[dict]) -> dict:
    by_id = {c["case_id"]: c for c in case_dicts}
    rows = []
    notes = []
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
        if row["status"] == "ok" and not row.get("correct"):
            row["failure"] = classify(
                answer=row.get("answer"),
                expected=case["expected"],
                finish_reason=row.get("finish_reason"),
                reasoning=row.get("reasoning"),
                messages=case["messages"],
            ).to_dict()
        rows.append(row)
        reported = r.get("prompt_tokens")
        if case["counted_length"] != case["length"]:
            notes.append(
                f"{case['case_id']}: requested {case['length']} tokens but the tokenizer counted {case['counted_length']}"
            )
        if reported is not None and reported != case["counted_length"]:
            notes.append(
                f"{case['case_id']}: counted {case['counted_length']} tokens but the server reported usage.prompt_tokens={reported}"
            )
    cells = cells_from_results(rows)
    provenance = store.get_meta("provenance") or {}
    write_failure_bundles(
        cfg.out / "bundles",
        rows,
        by_id,
        model=cfg.model,
        max_tokens=cfg.max_tokens,
        extra_body=cfg.extra_body,
        generation={"seed": cfg.seed, "value_digits": cfg.value_digits},
        provenance=provenance,
        limit=cfg.bundles,
    )
    return write_probe_outputs(
        cfg.out,
        cells=cells,
        results=rows,
        kind=cfg.kind,
        model=cfg.model,
        threshold=cfg.threshold,
        provenance=provenance,
        notes=notes,
        failures=summarize_failures(rows),
        endpoints=endpoint_breakdown(rows),
    )
