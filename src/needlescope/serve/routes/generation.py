"""The one generate-and-render path behind chat and text completions (and ``/generate``).

A route turns its body into prompt ids, ``SamplingParams`` and a ``Renderer``; ``respond``
admits the request, waits for it (or streams it) and renders the answer. The two OpenAI
shapes differ only in their ``Renderer``: the object names, how a choice and a streamed delta
look, and how logprobs are written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from needlescope.serve.connections import HALF_CLOSED
from needlescope.serve.engine import Engine
from needlescope.serve.errors import EngineError
from needlescope.serve.requests import Delta, Final, GenRequest, TokenOut, tokens_in_text
from needlescope.serve.routes.errors import ApiError, Names, engine_errors, to_api_error

__all__ = ["Serving", "Renderer", "ChatRenderer", "CompletionRenderer", "extensions", "usage"]

log = logging.getLogger("needlescope.serve")

DISCONNECT_POLL_S = 1.0  # how often a waiting non-streaming request checks that its client is still there


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def usage(final: Final) -> dict:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
        **extensions(final),
    }


def extensions(final: Final) -> dict:
    """needlescope's extension objects of ``usage`` (and ``/generate``'s ``meta_info``): the batch
    the request ran in and its speculative decoding (docs/serve.md)."""
    return {
        "needlescope_batch": final.batch.to_json() if final.batch else None,
        "needlescope_speculative": final.speculative.to_json() if final.speculative else None,
    }


def visible(tokens: list[TokenOut], final: Final) -> list[TokenOut]:
    """Tokens whose text is in the answer: a matched stop string's tokens are cut like its text."""
    if not isinstance(final.matched_stop, str):
        return list(tokens)
    return tokens[: tokens_in_text(tokens, len(final.text))]


class Renderer:
    """How one OpenAI endpoint writes an answer; subclasses fill in the shapes."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def choice(self, final: Final) -> dict:
        raise NotImplementedError

    def delta(self, text: str, finish: str | None, tokens: list[TokenOut], offset: int) -> dict:
        raise NotImplementedError

    def first(self) -> dict | None:
        """A chunk choice sent before any token (chat announces the role), or None."""
        return None

    @property
    def wants_tokens(self) -> bool:
        """Whether streamed tokens matter without text (their logprobs were asked for)."""
        return False


@dataclass
class ChatRenderer(Renderer):
    logprobs: bool
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @property
    def wants_tokens(self) -> bool:
        return self.logprobs

    def _lp(self, tokens: list[TokenOut]) -> dict | None:
        if not self.logprobs:
            return None

        def entry(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "surrogatepass"))}

        return {
            "content": [
                {**entry(t.shown, t.logprob), "top_logprobs": [entry(s, v) for _, s, v in (t.top or [])]}
                for t in tokens
            ]
        }

    def choice(self, final: Final) -> dict:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": final.text},
            "logprobs": self._lp(visible(final.tokens, final)),
            "finish_reason": final.finish_reason,
        }

    def delta(self, text, finish, tokens, offset) -> dict:
        return {
            "index": 0,
            "delta": {} if finish else {"content": text},
            "logprobs": None if finish else self._lp(tokens),
            "finish_reason": finish,
        }

    def first(self) -> dict:
        return {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }


@dataclass
class CompletionRenderer(Renderer):
    logprobs: int | None
    echo_text: str | None = None
    """The prompt as the client gave it, when ``echo``: it leads the text (and the logprobs)."""
    prompt_logprobs: bool = False
    """vLLM's ``prompt_logprobs``: a per-prompt-token dict of the token and its top alternatives."""
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    @property
    def wants_tokens(self) -> bool:
        return self.logprobs is not None

    def _lp(self, tokens: list[TokenOut], offset: int, prompt: list[TokenOut] = ()) -> dict | None:
        if self.logprobs is None:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offsets = _prompt_offsets(self.echo_text or "", [t.shown for t in prompt])
        for t in tokens:
            offsets.append(offset)
            offset += len(t.text)
        for t, at in zip([*prompt, *tokens], offsets):
            out["tokens"].append(t.shown)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append(None if t.logprob is None else {s: v for _, s, v in (t.top or [])})
            out["text_offset"].append(at)
        return out

    def choice(self, final: Final) -> dict:
        prompt = (final.prompt_logprobs or []) if self.echo_text is not None else []
        out = {
            "index": 0,
            "text": (self.echo_text or "") + final.text,
            "logprobs": self._lp(visible(final.tokens, final), len(self.echo_text or ""), prompt),
            "finish_reason": final.finish_reason,
        }
        if self.prompt_logprobs:
            out["prompt_logprobs"] = [None] + [
                _vllm_prompt_entry(t) for t in (final.prompt_logprobs or [])[1:]
            ]
        return out

    def delta(self, text, finish, tokens, offset) -> dict:
        return {"index": 0, "text": text, "logprobs": self._lp(tokens, offset), "finish_reason": finish}


def _prompt_offsets(text: str, pieces: list[str]) -> list[int]:
    """Where each prompt token's piece starts in the echoed prompt ``text``. The pieces show special
    tokens (``<|bos|>``) and unknown words (``<unk>``), which the text may not hold: text decoded
    from token ids leaves special tokens out, and a client's text holds the word, not ``<unk>``. A
    piece not found at the running position is looked for further on (what came before it belonged
    to the tokens not found); one not found at all starts at the running position and takes none."""
    offsets, pos = [], 0
    for piece in pieces:
        at = pos if text.startswith(piece, pos) else (text.find(piece, pos) if piece else -1)
        if at < 0:
            offsets.append(pos)
            continue
        offsets.append(at)
        pos = at + len(piece)
    return offsets


def _vllm_prompt_entry(t: TokenOut) -> dict:
    """vLLM's prompt-logprob entry: token id -> {logprob, rank, decoded_token}, chosen token first."""
    entry = {str(t.id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.shown}}
    for rank, (i, s, v) in enumerate(t.top or [], start=1):
        entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": s})
    return entry


@dataclass
class Serving:
    """What every route needs: the engine, the served name, and the generate-and-render path."""

    engine: Engine

    @property
    def name(self) -> str:
        return self.engine.cfg.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. This server serves: {self.name}",
                param="model",
                code="model_not_found",
            )

    def admit(self, req: GenRequest, names: Names) -> None:
        with engine_errors(names):
            self.engine.submit(req)

    async def wait_final(self, req: GenRequest, request: Request, names: Names) -> Final:
        """The request's ``Final``; an engine error it met is raised mapped; a client that
        leaves cancels it."""
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(req.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        log.info("client of %s went away; cancelling it", req.rid)
                        raise ApiError(499, "client disconnected", type="client_closed_request") from None
                    if request.scope.get(HALF_CLOSED) and self.engine.admission.withdraw(req):
                        log.info("client of %s closed its side before the request ran; withdrawn", req.rid)
                        raise ApiError(499, "client disconnected", type="client_closed_request") from None
                    continue
                if isinstance(ev, EngineError):
                    finished = True
                    raise to_api_error(ev, names)
                if isinstance(ev, Final):
                    finished = True
                    return ev
        finally:
            if not finished:
                self.engine.cancel(req)

    async def events(self, req: GenRequest) -> AsyncIterator[Delta | Final | EngineError]:
        finished = False
        try:
            while True:
                ev = await req.events.get()
                yield ev
                if isinstance(ev, (Final, EngineError)):
                    finished = True
                    return
        finally:
            if not finished:
                self.engine.cancel(req)

    async def respond(
        self,
        request: Request,
        req: GenRequest,
        renderer: Renderer,
        names: Names,
        include_usage: bool = False,
    ):
        """Admit ``req``, then answer it in ``renderer``'s shape, streamed when ``req.stream``."""
        self.admit(req, names)
        head = {"id": renderer.id_prefix + req.rid, "created": int(time.time()), "model": self.name}
        if req.stream:
            chunks = self._stream(
                req, {**head, "object": renderer.chunk_object}, renderer, names, include_usage
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        final = await self.wait_final(req, request, names)
        return {**head, "object": renderer.object, "choices": [renderer.choice(final)], "usage": usage(final)}

    async def _stream(
        self, req: GenRequest, head: dict, renderer: Renderer, names: Names, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE chunks of one streamed completion, a usage chunk last if asked, then ``[DONE]``."""

        def chunk(choices: list, **extra) -> dict:
            out = {**head, "choices": choices, **extra}
            if include_usage:
                out.setdefault("usage", None)
            return out

        first = renderer.first()
        if first is not None:
            yield _sse(chunk([first]))
        offset = 0
        async for ev in self.events(req):
            if isinstance(ev, EngineError):
                yield _sse(to_api_error(ev, names).body())
                break
            if isinstance(ev, Delta):
                if ev.text or (renderer.wants_tokens and ev.tokens):
                    yield _sse(chunk([renderer.delta(ev.text, None, ev.tokens, offset)]))
                    offset += len(ev.text)
                continue
            yield _sse(chunk([renderer.delta("", ev.finish_reason, [], offset)]))
            if include_usage:
                yield _sse(chunk([], usage=usage(ev)))
        yield _sse("[DONE]")
