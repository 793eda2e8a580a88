"""A request's answer as the engine's worker builds it, token by token: sampling a row's next
token into its text, stop strings and stop tokens (a possible stop's start held back from the
stream), streamed deltas, logprobs of the answer and of the prompt, and the final answer with the
indexer capture encoded as SGLang does.

``Answers`` is ``serve.engine.Engine``'s base: its methods read the engine's worker-thread
tokenizer copy (``_decoder``), ``eos_ids``, ``tokens``, ``metrics`` and indexer ``capture``
(``csa_layers``, ``index_topk``), and answer through ``Engine._finish``. Only the worker thread
calls them.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from needlescope.serve.requests import (
    BatchInfo,
    Delta,
    Final,
    GenRequest,
    SpecInfo,
    TokenOut,
    TopkRows,
    tokens_in_text,
)
from needlescope.serve.sampling import pick

__all__ = ["Answers", "Row", "encode_indexer_topk"]


def encode_indexer_topk(topk: torch.Tensor, dtype: str = "<i4") -> str:
    """SGLang's encoding: base64 of the little-endian int32 bytes of ``topk`` [N, layers, k]
    (``dtype`` "<f4": the same for the float32 logits of ``return_indexer_logits``)."""
    return base64.b64encode(np.ascontiguousarray(topk.numpy().astype(dtype)).tobytes()).decode("ascii")


@dataclass
class Row:
    """Decode state of one request inside a batch."""

    req: GenRequest
    gen: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    unsent_tokens: list[TokenOut] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_logprobs: list[TokenOut] | None = None
    cached_tokens: int = 0
    batch: BatchInfo = field(default_factory=lambda: BatchInfo("static"))
    spec: SpecInfo = field(default_factory=lambda: SpecInfo(0))
    finished: bool = False  # answered (or failed) and counted out of the running requests


class Answers:
    """The answer side of ``Engine`` (module docstring)."""

    def _answer(self, row: Row, capture: TopkRows | None) -> None:
        self._finish(row, self._final(row, capture))

    def _advance(self, row: Row, logits: torch.Tensor) -> None:
        """Sample one token for ``row``, update its text, check stops, stream a delta."""
        req, p = row.req, row.req.params
        early = len(row.output_ids) < p.min_tokens
        banned = () if not early else tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_ids))
        seen = None
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.prompt_ids + row.output_ids, dtype=torch.long)
        tok = pick(logits, p, seen, banned, row.gen)
        if not row.output_ids:
            self.metrics.ttft.observe(time.monotonic() - req.admitted_at)
        row.output_ids.append(tok)
        self.metrics.generation_tokens.inc()
        text = self._decoder.decode(row.output_ids, skip_special_tokens=True)
        stop_id = tok in p.stop_token_ids and not early
        if stop_id:
            text = row.text  # a stop token's text is not part of the answer
        piece = text[len(row.text) :] if text.startswith(row.text) else text
        special = tok in self.tokens.special_ids
        out = TokenOut(id=tok, text=piece, shown=self._piece(row.output_ids[:-1], tok) if special else piece)
        if p.logprobs is not None:
            self._score(out, logits, p.logprobs, row.output_ids[:-1])
        row.tokens.append(out)
        row.unsent_tokens.append(out)
        row.text = text
        visible = len(text)
        if (not p.ignore_eos and tok in self.eos_ids) or stop_id:
            row.finish_reason, row.matched_stop = "stop", tok
        else:
            cut = None
            if not early:
                start = max(0, row.sent - max((len(s) for s in p.stop), default=0))
                cut = _find_stop(text, p.stop, start=start)
            if cut is not None:
                visible, row.matched_stop = cut
                row.text = text[:visible]
                row.finish_reason = "stop"
            elif len(row.output_ids) >= p.max_new_tokens:
                row.finish_reason = "length"
            else:
                visible = len(text) - _held_back(text, p.stop)
        if req.stream and (visible > row.sent or row.finish_reason is not None):
            tokens = row.unsent_tokens
            if row.finish_reason == "stop" and isinstance(row.matched_stop, str):
                # the matched stop string's tokens are cut like its text, as in the whole answer
                first = len(row.tokens) - len(tokens)
                tokens = row.tokens[first : max(first, tokens_in_text(row.tokens, len(row.text)))]
            req.emit(Delta(text=row.text[row.sent : visible], tokens=tokens))
            row.sent = visible
            row.unsent_tokens = []

    def _score(self, out: TokenOut, logits: torch.Tensor, top: int, before: list[int]) -> None:
        """Fill ``out``'s logprob, rank and ``top`` alternatives from ``logits`` [V] (the model's own)."""
        lp = torch.log_softmax(logits, dim=-1)
        out.logprob = float(lp[out.id])
        out.rank = int((lp > lp[out.id]).sum()) + 1
        if top:
            best = torch.topk(lp, top)
            out.top = [
                (int(i), self._piece(before, int(i)), float(v)) for v, i in zip(best.values, best.indices)
            ]

    def _score_prompt(self, row: Row, logits: torch.Tensor) -> None:
        """Prompt logprobs of ``row`` from its prefill ``logits`` [P, V] (the first token has none)."""
        ids = row.req.prompt_ids
        top = row.req.params.prompt_logprobs or 0
        first = self._piece([], ids[0])
        scored = [TokenOut(id=ids[0], text=first, shown=first)]
        for t in range(1, len(ids)):
            shown = self._piece(ids[:t], ids[t])
            out = TokenOut(id=ids[t], text=shown, shown=shown)
            self._score(out, logits[t - 1], top, ids[:t])
            scored.append(out)
        row.prompt_logprobs = scored

    def _piece(self, before: list[int], tok: int) -> str:
        """Text of ``tok`` after the token ids ``before`` (keeps leading spaces; special tokens shown)."""
        if not before:
            return self._decoder.decode([tok], skip_special_tokens=False)
        prev = before[-1]
        head = self._decoder.decode([prev], skip_special_tokens=False)
        both = self._decoder.decode([prev, tok], skip_special_tokens=False)
        return both[len(head) :] if both.startswith(head) else both

    def _final(self, row: Row, capture: TopkRows | None) -> Final:
        final = Final(
            finish_reason=row.finish_reason or "abort",
            text=row.text,
            output_ids=list(row.output_ids),
            tokens=row.tokens,
            prompt_tokens=len(row.req.prompt_ids),
            matched_stop=row.matched_stop,
            prompt_logprobs=row.prompt_logprobs,
            cached_tokens=row.cached_tokens,
            batch=row.batch,
            speculative=row.spec,
        )
        if capture is not None and self.capture is not None:
            positions = capture.pick(final.prompt_tokens + final.completion_tokens - 1)
            topk = self._indexer_topk(final.prompt_tokens + final.completion_tokens - 1)[positions]
            final.indexer_topk = encode_indexer_topk(topk)
            final.indexer_topk_shape = tuple(topk.shape)
            if capture.selected:
                final.indexer_topk_positions = positions
            if capture.logits:
                logits = self._indexer_logits(positions)
                final.indexer_logits = encode_indexer_topk(logits, "<f4")
                final.indexer_logits_shape = tuple(logits.shape)
        return final

    def _indexer_topk(self, n_rows: int) -> torch.Tensor:
        """[n_rows, CSA layers, index_topk] int32 top-k of every fed position, -1 padded."""
        layers = []
        for layer in self.csa_layers:
            positions, topk = self.capture.rows(layer, self.index_topk)
            if positions.tolist() != list(range(n_rows)):
                raise RuntimeError(
                    f"indexer capture of layer {layer} covers positions {positions[:3].tolist()}..."
                    f"{positions[-3:].tolist()} ({len(positions)} rows), expected 0..{n_rows - 1}"
                )
            layers.append(topk)
        return torch.stack(layers, dim=1).to(torch.int32)

    def _indexer_logits(self, positions: list[int]) -> torch.Tensor:
        """float32 [len(positions), CSA layers, W]: the logits each row's top-k ranked, -inf padded
        to the longest row (a row holds the entries complete at its position)."""
        layers = []
        for layer in self.csa_layers:
            kept, rows = self.capture.score_rows(layer)
            row_of = {int(p): r for p, r in zip(kept.tolist(), rows)}
            missing = [p for p in positions if p not in row_of]
            if missing:
                raise RuntimeError(f"indexer score rows of layer {layer} lack positions {missing[:3]}")
            layers.append([row_of[p] for p in positions])
        width = max((len(r) for rows in layers for r in rows), default=0)
        out = torch.full((len(positions), len(layers), width), float("-inf"), dtype=torch.float32)
        for j, rows in enumerate(layers):
            for i, r in enumerate(rows):
                out[i, j, : len(r)] = r
        return out


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """(cut position, stop string) of the earliest stop string in ``text[start:]``."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could begin a stop string (not streamed yet)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
