"""FastAPI routes of ``needlescope serve`` and the uvicorn runner.

OpenAI: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` (both with SSE streaming).
vLLM: ``/tokenize``, ``/detokenize`` (also under ``/v1``). SGLang: ``/generate``,
``/get_server_info``, ``/health``. Prometheus: ``/metrics``.

Every error is the OpenAI envelope with the HTTP status that fits: 400 bad request (also
malformed JSON and failed validation), 404 unknown model or route, 503 queue full.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from needlescope import __version__
from needlescope.serve.admission import Overloaded
from needlescope.serve.engine import Delta, Engine, Final, GenRequest, TokenOut
from needlescope.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    error_body,
)

__all__ = ["create_app", "run_server"]

log = logging.getLogger("needlescope.serve")

DISCONNECT_POLL_S = 1.0  # how often a waiting non-streaming request checks that its client is still there

ROUTES = (
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/v1/tokenize",
    "/detokenize",
    "/v1/detokenize",
    "/generate",
    "/health",
    "/get_server_info",
    "/version",
    "/metrics",
)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _usage(final: Final) -> dict:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _chat_logprobs(tokens: list[TokenOut]) -> dict:
    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.text, t.logprob), "top_logprobs": [entry(s, v) for _, s, v in (t.top or [])]}
            for t in tokens
        ]
    }


def _completion_logprobs(tokens: list[TokenOut], offset: int = 0) -> dict:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{s: v for _, s, v in (t.top or [])} for t in tokens],
        "text_offset": offsets,
    }


def _visible(tokens: list[TokenOut], final: Final) -> list[TokenOut]:
    """Tokens whose text is in the answer: a matched stop string's tokens are cut like its text."""
    out, n = [], 0
    for t in tokens:
        if n >= len(final.text) and final.matched_stop is not None and isinstance(final.matched_stop, str):
            break
        out.append(t)
        n += len(t.text)
    return out


def create_app(engine: Engine) -> FastAPI:
    """The ASGI app around a constructed (not yet started) ``Engine``; the lifespan starts it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.close()

    app = FastAPI(title="needlescope serve", version=__version__, lifespan=lifespan)
    metrics = engine.metrics
    name = engine.cfg.model_name

    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return JSONResponse(error_body(msg, type="invalid_request_error", code="invalid_json"), 400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        parts = [
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
            for e in errors
        ]
        return JSONResponse(
            error_body(
                "invalid request: " + "; ".join(parts[:5]),
                type="invalid_request_error",
                param=".".join(loc) or None,
            ),
            400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(msg, type="invalid_request_error", code=code), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"), 500
        )

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. This server serves: {name}",
                param="model",
                code="model_not_found",
            )

    def admit(req: GenRequest) -> None:
        try:
            engine.submit(req)
        except Overloaded as exc:
            raise _Busy(str(exc)) from None

    async def wait_final(req: GenRequest, request: Request) -> Final:
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(req.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        log.info("client of %s went away; cancelling it", req.rid)
                        finished = True
                        engine.cancel(req)
                        raise ApiError(499, "client disconnected", type="client_closed_request") from None
                    continue
                if isinstance(ev, ApiError):
                    finished = True
                    raise ev
                if isinstance(ev, Final):
                    finished = True
                    return ev
        finally:
            if not finished:
                engine.cancel(req)

    async def stream_events(req: GenRequest) -> AsyncIterator[Delta | Final | ApiError]:
        finished = False
        try:
            while True:
                ev = await req.events.get()
                yield ev
                if isinstance(ev, (Final, ApiError)):
                    finished = True
                    return
        finally:
            if not finished:
                engine.cancel(req)

    @app.exception_handler(_Busy)
    async def busy(_: Request, exc: _Busy):
        body = error_body(str(exc), type="server_overloaded", code="queue_full")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    def unsupported(body, fields: dict[str, object]) -> None:
        if body.n != 1:
            raise ApiError(400, f"n={body.n} is not supported; send n=1 (one choice per request)", param="n")
        for field, neutral in fields.items():
            value = getattr(body, field, None)
            if value not in (None, neutral):
                raise ApiError(400, f"{field}={value!r} is not supported by this server", param=field)

    # ---- OpenAI ----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(engine.started_at),
                    "owned_by": "needlescope",
                    "root": str(engine.path),
                    "max_model_len": engine.context_length,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        unsupported(body, {"presence_penalty": 0.0, "frequency_penalty": 0.0})
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = engine.chat_ids(messages, body.add_generation_prompt)
        use_max_completion = body.max_completion_tokens is not None
        params = engine.sampling(
            len(ids),
            max_tokens=body.max_completion_tokens if use_max_completion else body.max_tokens,
            max_tokens_param="max_completion_tokens" if use_max_completion else "max_tokens",
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        )
        req = GenRequest(ids, params, stream=body.stream)
        admit(req)
        rid, created = "chatcmpl-" + req.rid, int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _chat_stream(stream_events(req), rid, created, name, usage, body.logprobs),
                media_type="text/event-stream",
            )
        final = await wait_final(req, request)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": final.text},
                    "logprobs": _chat_logprobs(_visible(final.tokens, final)) if body.logprobs else None,
                    "finish_reason": final.finish_reason,
                }
            ],
            "usage": _usage(final),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        unsupported(body, {"presence_penalty": 0.0, "frequency_penalty": 0.0, "echo": False})
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(
                    400, "batched prompts are not supported; send one prompt per request", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = engine.text_ids(prompt)
        else:
            ids = list(prompt)
            engine.check_ids(ids, "prompt")
        params = engine.sampling(
            len(ids),
            max_tokens=body.max_tokens,
            default_max_tokens=16,  # OpenAI's default for completions
            prompt_param="prompt",
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
            logprobs=body.logprobs,
        )
        req = GenRequest(ids, params, stream=body.stream)
        admit(req)
        rid, created = "cmpl-" + req.rid, int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _completion_stream(stream_events(req), rid, created, name, usage, body.logprobs is not None),
                media_type="text/event-stream",
            )
        final = await wait_final(req, request)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "text": final.text,
                    "logprobs": _completion_logprobs(_visible(final.tokens, final))
                    if body.logprobs is not None
                    else None,
                    "finish_reason": final.finish_reason,
                }
            ],
            "usage": _usage(final),
        }

    # ---- vLLM tokenizer endpoints ---------------------------------------------------------

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = engine.chat_ids(messages, body.add_generation_prompt)
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = engine.text_ids(body.prompt, add_special_tokens=add)
        out: dict = {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        engine.check_ids(body.tokens, "tokens")
        return {"prompt": engine.decode(body.tokens)}

    # ---- SGLang native ---------------------------------------------------------------------

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", param="text")
        if body.stream:
            raise ApiError(
                400, "stream=true is not supported on /generate; use /v1/completions", param="stream"
            )
        if body.return_indexer_topk and not engine.is_v4:
            raise ApiError(
                400,
                f"return_indexer_topk needs a DeepSeek-V4 model; this server runs a {engine.architecture}",
                param="return_indexer_topk",
            )
        if body.text is not None:
            ids = engine.text_ids(body.text)
        else:
            ids = list(body.input_ids)
            engine.check_ids(ids, "input_ids")
        sp = body.sampling_params
        params = engine.sampling(
            len(ids),
            max_tokens=sp.max_new_tokens,
            default_max_tokens=128,  # SGLang's default
            prompt_param="text" if body.text is not None else "input_ids",
            max_tokens_param="sampling_params.max_new_tokens",
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
            stop=sp.stop,
            ignore_eos=sp.ignore_eos,
            logprobs=0 if body.return_logprob else None,
        )
        req = GenRequest(ids, params, capture=body.return_indexer_topk)
        admit(req)
        final = await wait_final(req, request)
        if final.finish_reason == "length":
            reason: dict = {"type": "length", "length": final.completion_tokens}
        else:
            reason = {"type": final.finish_reason, "matched": final.matched_stop}
        meta: dict = {
            "id": req.rid,
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "cached_tokens": 0,
            "finish_reason": reason,
            "e2e_latency": time.monotonic() - req.admitted_at,
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [[t.logprob, t.id, None] for t in final.tokens]
        if final.indexer_topk is not None:
            meta["indexer_topk"] = final.indexer_topk
            meta["indexer_topk_shape"] = list(final.indexer_topk_shape)
        return {"text": final.text, "output_ids": final.output_ids, "meta_info": meta}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/get_server_info")
    async def server_info():
        return {**engine.info(), "args": engine.cfg.to_dict()}

    @app.get("/version")
    async def version():
        return {"version": __version__, "server": "needlescope"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _CountRequests:
    """Pure ASGI middleware counting requests by route and status (``BaseHTTPMiddleware`` would
    hide client disconnects from ``Request.is_disconnected``)."""

    def __init__(self, app, metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in ROUTES else "other", str(status["code"])).inc()


class _Busy(Exception):
    """The queue is full (HTTP 503 with Retry-After)."""


async def _stream(
    events: AsyncIterator,
    head: dict,
    include_usage: bool,
    choice: Callable[[str, str | None, dict | None], dict],
    logprobs_of: Callable[[list, int], dict] | None,
    first: dict | None = None,
) -> AsyncIterator[str]:
    """SSE chunks of one streamed completion: ``head`` (id, object, created, model) on each,
    ``choice(text, finish_reason, logprobs)`` building the choice, a usage chunk last if asked."""

    def chunk(choices: list, **extra) -> dict:
        out = {**head, "choices": choices, **extra}
        if include_usage:
            out.setdefault("usage", None)
        return out

    if first is not None:
        yield _sse(chunk([first]))
    offset = 0
    async for ev in events:
        if isinstance(ev, ApiError):
            yield _sse(ev.body())
            break
        if isinstance(ev, Delta):
            if ev.text or (logprobs_of and ev.tokens):
                lp = logprobs_of(ev.tokens, offset) if logprobs_of else None
                yield _sse(chunk([choice(ev.text, None, lp)]))
                offset += len(ev.text)
            continue
        yield _sse(chunk([choice("", ev.finish_reason, None)]))
        if include_usage:
            yield _sse(chunk([], usage=_usage(ev)))
    yield _sse("[DONE]")


def _chat_stream(events, rid: str, created: int, model: str, include_usage: bool, logprobs: bool):
    def choice(text: str, finish: str | None, lp: dict | None) -> dict:
        return {
            "index": 0,
            "delta": {} if finish else {"content": text},
            "logprobs": lp,
            "finish_reason": finish,
        }

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    first = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    lp_of = (lambda tokens, _offset: _chat_logprobs(tokens)) if logprobs else None
    return _stream(events, head, include_usage, choice, lp_of, first)


def _completion_stream(events, rid: str, created: int, model: str, include_usage: bool, logprobs: bool):
    def choice(text: str, finish: str | None, lp: dict | None) -> dict:
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    return _stream(events, head, include_usage, choice, _completion_logprobs if logprobs else None)


class _Server(uvicorn.Server):
    """uvicorn server that reports its bound port once it is listening."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str, int], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(host, port)


def run_server(engine: Engine, on_ready: Callable[[str, int], None] | None = None) -> None:
    """Serve ``engine`` until SIGINT/SIGTERM; ``on_ready(host, port)`` runs once it listens."""
    app = create_app(engine)
    config = uvicorn.Config(
        app,
        host=engine.cfg.host,
        port=engine.cfg.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    _Server(config, on_ready).run()
