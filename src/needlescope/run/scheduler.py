"""Runs cases against a target with bounded concurrency, recording every outcome durably."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from needlescope.errors import ProbeError
from needlescope.run.store import ResultStore
from needlescope.targets.client import ChatTarget


async def _one(
    case: dict,
    target: ChatTarget,
    store: ResultStore,
    sem: asyncio.Semaphore,
    *,
    max_tokens: int,
    extra_body: dict | None,
    score: Callable[[str, list[str]], bool],
    on_result: Callable[[dict], None] | None,
) -> None:
    case_id = case["case_id"]
    async with sem:
        start = time.monotonic()
        res = None
        try:
            res = await target.chat(case["messages"], max_tokens=max_tokens, extra_body=extra_body)
            correct = bool(score(res.text, list(case["expected"])))
            row = {
                "status": "ok",
                "correct": correct,
                "answer": res.text,
                "reasoning": res.reasoning,
                "finish_reason": res.finish_reason,
                "prompt_tokens": res.prompt_tokens,
                "cached_tokens": res.cached_tokens,
                "latency_s": res.latency_s,
                "attempts": res.attempts,
                "base_url": res.base_url,
                "replica": res.replica,
            }
        except ProbeError as e:
            # A failed request says nothing about recall: it is an error, never a miss.
            row = {
                "status": "error",
                "error_kind": e.kind,
                "error": str(e),
                "latency_s": time.monotonic() - start,
                "attempts": e.attempts,
            }
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # A bug in one case (scorer, malformed case) is recorded so it is visible, and the run goes on.
            row = {
                "status": "error",
                "error_kind": "internal",
                "error": f"{type(e).__name__}: {e}",
                "latency_s": time.monotonic() - start,
                "attempts": None if res is None else res.attempts,
            }
        store.record(case_id, **row)
    if on_result is not None:
        on_result({"case_id": case_id, **row})


async def run_cases(
    cases: list[dict],
    target: ChatTarget,
    store: ResultStore,
    *,
    concurrency: int,
    max_tokens: int,
    extra_body: dict | None,
    score: Callable[[str, list[str]], bool],
    on_result: Callable[[dict], None] | None = None,
) -> None:
    """Send ``cases`` in the given order (the caller orders them for prefix-cache reuse).

    Tasks are created in order and the semaphore is FIFO, so requests start in order too.
    """
    sem = asyncio.Semaphore(max(1, concurrency))
    tasks = [
        asyncio.create_task(
            _one(
                c,
                target,
                store,
                sem,
                max_tokens=max_tokens,
                extra_body=extra_body,
                score=score,
                on_result=on_result,
            )
        )
        for c in cases
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
