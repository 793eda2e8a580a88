"""What travels between the HTTP loop and the engine thread: a request in, events out.

A ``GenRequest`` is built by a route, admitted, and answered through its asyncio queue with
``Delta`` (streamed progress), then one ``Final`` or one ``EngineError``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict, dataclass

from needlescope.serve.errors import BadValue, EngineError
from needlescope.serve.sampling import SamplingParams

__all__ = [
    "BatchInfo",
    "SpecInfo",
    "TokenOut",
    "tokens_in_text",
    "Delta",
    "Final",
    "TopkRows",
    "GenRequest",
    "MAX_INDEXER_LOGITS_BYTES",
    "MAX_INDEXER_TOPK_BYTES",
    "indexer_topk_bytes",
]

MAX_INDEXER_TOPK_BYTES = 16 * 2**20
"""Cap on the raw int32 bytes of one ``indexer_topk`` payload (base64 adds a third)."""

MAX_INDEXER_LOGITS_BYTES = 16 * 2**20
"""Cap on the raw float32 bytes of one ``indexer_logits`` payload (rows x layers x entries x 4)."""


def indexer_topk_bytes(rows: int, layers: int, index_topk: int) -> int:
    """Raw bytes of an ``indexer_topk`` payload: 4 x rows x CSA layers x index_topk."""
    return 4 * rows * layers * index_topk


@dataclass
class TokenOut:
    """One token with its log-probability: ``text`` is its share of the answer's text (``""``
    for a special token, which the answer leaves out), ``shown`` how logprobs render it (a
    special token as its own string, the same way for the chosen token and the alternatives)."""

    id: int
    text: str
    shown: str
    logprob: float | None = None
    top: list[tuple[int, str, float]] | None = None
    rank: int | None = None


def tokens_in_text(tokens: list[TokenOut], n_chars: int) -> int:
    """How many of ``tokens`` (their texts joined: the answer so far) start before character
    ``n_chars``: the tokens of an answer cut there (a matched stop string's tokens are cut like
    its text, in the whole answer and in the stream alike)."""
    count, start = 0, 0
    for t in tokens:
        if start >= n_chars:
            break
        count += 1
        start += len(t.text)
    return count


@dataclass
class Delta:
    """Streamed progress: newly visible text and the tokens generated since the last delta."""

    text: str
    tokens: list[TokenOut]


@dataclass
class BatchInfo:
    """The batch a request ran in (``usage.needlescope_batch``)."""

    mode: str
    """``continuous`` (requests join and leave the running batch at any decode step) or ``static``."""
    prefill_batch: int = 0
    """Requests prefilled together with it (itself included)."""
    max_running: int = 0
    """The most requests decoding at one step while it ran (itself included)."""
    joined_mid_flight: bool = False
    """Whether it joined while others were decoding."""
    joined_beside: int = 0
    """Requests that joined mid-flight while it was decoding."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class SpecInfo:
    """Speculative decoding of one request (``usage.needlescope_speculative``)."""

    draft_tokens: int
    """The draft depth it ran with (0: no speculative decoding)."""
    verify_steps: int = 0
    """Verify passes (each scored its drafts in one forward)."""
    proposed: int = 0
    """Draft tokens proposed."""
    accepted: int = 0
    """Draft tokens accepted."""

    def record(self, proposed: int) -> None:
        """A verify pass of ``proposed`` drafts (the engine counts ``accepted`` one by one)."""
        self.verify_steps += 1
        self.proposed += proposed

    def to_json(self) -> dict:
        rate = self.accepted / self.proposed if self.proposed else None
        return {**asdict(self), "acceptance_rate": rate}


@dataclass
class Final:
    finish_reason: str
    text: str
    output_ids: list[int]
    tokens: list[TokenOut]
    prompt_tokens: int
    matched_stop: str | int | None = None
    prompt_logprobs: list[TokenOut] | None = None
    """Every prompt token scored (the first one has ``logprob`` None), when asked for."""
    indexer_topk: str | None = None
    indexer_topk_shape: tuple[int, int, int] | None = None
    indexer_topk_positions: list[int] | None = None
    indexer_logits: str | None = None
    indexer_logits_shape: tuple[int, int, int] | None = None
    cached_tokens: int = 0
    """Prompt tokens whose state came from the prefix cache."""
    batch: BatchInfo | None = None
    speculative: SpecInfo | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class TopkRows:
    """Which rows of the indexer top-k capture to return: explicit ``positions``, the ``last``
    N, or (neither) every fed position. ``selected`` says whether the caller chose; ``logits``
    whether the logits each row's top-k ranked come back too."""

    positions: tuple[int, ...] | None = None
    last: int | None = None
    logits: bool = False

    @property
    def selected(self) -> bool:
        return self.positions is not None or self.last is not None

    def check(self, max_rows: int, layers: int, index_topk: int, max_entries: int = 0) -> None:
        """BadValue unless the rows are valid for at most ``max_rows`` fed positions and the
        payloads stay under ``MAX_INDEXER_TOPK_BYTES`` (and, with ``logits``, rows of at most
        ``max_entries`` compressed entries under ``MAX_INDEXER_LOGITS_BYTES``)."""
        if self.positions is not None and self.last is not None:
            raise BadValue("indexer_topk_positions", "and indexer_topk_last exclude each other; give one")
        if self.positions is not None:
            if not self.positions or any(not 0 <= p < max_rows for p in self.positions):
                raise BadValue(
                    "indexer_topk_positions", f"must be a non-empty list of positions in 0..{max_rows - 1}"
                )
            rows = len(self.positions)
        elif self.last is not None:
            if self.last < 1:
                raise BadValue("indexer_topk_last", f"must be at least 1; got {self.last}")
            rows = min(self.last, max_rows)
        else:
            rows = max_rows
        size = indexer_topk_bytes(rows, layers, index_topk)
        if size > MAX_INDEXER_TOPK_BYTES:
            raise BadValue(
                "return_indexer_topk",
                f"would return up to {rows} rows x {layers} layers x {index_topk} = {size} bytes, over the "
                f"{MAX_INDEXER_TOPK_BYTES}-byte cap; choose rows with indexer_topk_last or "
                "indexer_topk_positions, or lower max_new_tokens",
            )
        logits_size = 4 * rows * layers * max_entries
        if self.logits and logits_size > MAX_INDEXER_LOGITS_BYTES:
            raise BadValue(
                "return_indexer_logits",
                f"would return up to {rows} rows x {layers} layers x {max_entries} entries x 4 = {logits_size} "
                f"bytes, over the {MAX_INDEXER_LOGITS_BYTES}-byte cap; choose fewer rows with indexer_topk_last "
                "or indexer_topk_positions",
            )

    def first_row(self, prompt_len: int) -> int:
        """The lowest position ``pick`` can return for a prompt of ``prompt_len`` tokens (at least
        ``prompt_len - 1`` positions are fed), so rows before it need not be kept."""
        if self.positions is not None:
            return min(self.positions)
        if self.last is not None:
            return max(0, prompt_len - 1 - self.last)
        return 0

    def pick(self, n_rows: int) -> list[int]:
        """The positions to return out of ``n_rows`` fed ones (explicit ones past the end dropped)."""
        if self.positions is not None:
            return [p for p in self.positions if p < n_rows]
        if self.last is not None:
            return list(range(max(0, n_rows - self.last), n_rows))
        return list(range(n_rows))


class GenRequest:
    """A request travelling from the HTTP loop to the engine thread and back."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        capture: TopkRows | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.rid = uuid.uuid4().hex
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = stream
        self.capture = capture
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.admitted_at = time.monotonic()

    async def last_event(self) -> Final | EngineError:
        """Its ``Final`` or error, the streamed ``Delta`` events before it skipped (in-process
        callers: tests and benches driving an engine without HTTP)."""
        event = await self.events.get()
        while isinstance(event, Delta):
            event = await self.events.get()
        return event

    def emit(self, event: Delta | Final | EngineError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass
