"""Runs cases against a target with bounded concurrency, recording every outcome durably."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection

from needlescope.cases.scoring import names_any, prompt_rivals
from needlescope.errors import ProbeError
from needlescope.run.store import ResultStore
from needlescope.targets.client import ChatTarget

Grade = Callable[[dict], Awaitable[dict]]
"""A case -> its graded record (``analysis.margins.answer_score`` plus ``method``)."""


async def _chat_row(
    case: dict,
    target: ChatTarget,
    *,
    max_tokens: int,
    extra_body: dict | None,
    score: Callable[[str, list[str]], bool],
) -> dict:
    start = time.monotonic()
    res = None
    try:
        res = await target.chat(case["messages"], max_tokens=max_tokens, extra_body=extra_body)
        # An answer that names another value of the prompt (a distractor's) beside the right one
        # is a hedge, not a recall: a miss, whatever ``score`` says (cases.scoring).
        rivals = prompt_rivals(case["messages"], case["expected"])
        correct = bool(score(res.text, list(case["expected"]))) and not names_any(res.text, rivals)
        return {
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
            "connection": res.connection,
        }
    except ProbeError as e:
        # A failed request says nothing about recall: it is an error, never a miss.
        return {
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
        return {
            "status": "error",
            "error_kind": "internal",
            "error": f"{type(e).__name__}: {e}",
            "latency_s": time.monotonic() - start,
            "attempts": None if res is None else res.attempts,
        }


async def _grade_case(case: dict, grade: Grade, store: ResultStore) -> None:
    """Score the gold answer of ``case``; a failure is recorded as a graded error (retried on resume)."""
    try:
        data = await grade(case)
    except ProbeError as e:
        store.record_graded(case["case_id"], method=None, error=f"{e.kind}: {e}")
    except asyncio.CancelledError:
        raise
    except Exception as e:
        store.record_graded(case["case_id"], method=None, error=f"internal: {type(e).__name__}: {e}")
    else:
        store.record_graded(case["case_id"], method=data["method"], data=data)


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
    chat_ids: Collection[str] | None = None,
    grade: Grade | None = None,
    grade_ids: Collection[str] = (),
) -> None:
    """Send ``cases`` in the given order (the caller orders them for prefix-cache reuse).

    Each case gets its chat (when in ``chat_ids``; None: every case), then its teacher-forced gold
    score (when ``grade`` is given and it is in ``grade_ids``), in one slot, so the scoring
    request follows its chat while the prefix is warm. Tasks are created in order and the
    semaphore is FIFO, so requests start in order too.
    """
    sem = asyncio.Semaphore(max(1, concurrency))
    grade_ids = set(grade_ids) if grade is not None else set()

    async def one(case: dict) -> None:
        case_id = case["case_id"]
        row = None
        async with sem:
            if chat_ids is None or case_id in chat_ids:
                row = await _chat_row(case, target, max_tokens=max_tokens, extra_body=extra_body, score=score)
                store.record(case_id, **row)
            if case_id in grade_ids:
                await _grade_case(case, grade, store)
        if row is not None and on_result is not None:
            on_result({"case_id": case_id, **row})

    tasks = [asyncio.create_task(one(c)) for c in cases]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
