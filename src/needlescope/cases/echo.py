"""Exact-copy tasks: the echo probe of speculative decoding.

A speculative decoder drafts tokens and keeps those its verify pass accepts. A verify pass that
keeps too little state for the draft (too few compressor or indexer rows) corrupts the copy more
as the draft grows; a copy task has exactly one right answer, so any departure is corruption.
Each task asks for ``items`` numbers of ``digits`` digits back, in order, space-separated (digits
are in every tokenizer's vocabulary). Pure: no server, no I/O.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from .scoring import answer_tokens, strip_reasoning

__all__ = ["EchoTask", "echo_tasks", "exact_copy"]

PROMPT = "Repeat these {n} numbers exactly, in order, separated by spaces: {items}"


@dataclass(frozen=True)
class EchoTask:
    task_id: str
    items: tuple[str, ...]
    messages: tuple[dict, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def echo_tasks(count: int, items: int, digits: int, seed: int) -> list[EchoTask]:
    """``count`` copy tasks of ``items`` distinct ``digits``-digit numbers each (no leading
    zero), from a string-seeded generator (the same tasks in every Python run)."""
    rng = random.Random(f"needlescope|echo|{seed}|{items}|{digits}")
    tasks = []
    for t in range(count):
        chosen: list[str] = []
        while len(chosen) < items:
            x = str(rng.randrange(10 ** (digits - 1), 10**digits))
            if x not in chosen:
                chosen.append(x)
        prompt = PROMPT.format(n=items, items=" ".join(chosen))
        tasks.append(EchoTask(f"echo-N{items}-T{t}", tuple(chosen), ({"role": "user", "content": prompt},)))
    return tasks


def exact_copy(answer: str, items: tuple[str, ...]) -> bool:
    """Whether the answer (after any reasoning block) is the numbers, in order, and nothing more
    (word and number tokens as the scorer reads them; separators and a final period are free)."""
    return answer_tokens(strip_reasoning(answer)) == list(items)
