"""The ASGI app of ``needlescope serve`` and the uvicorn runner.

OpenAI: ``/v1/models`` (+ ``/v1/models/{id}``), ``/v1/chat/completions``, ``/v1/completions``
(both with SSE streaming). vLLM: ``/tokenize``, ``/detokenize`` (also under ``/v1``),
``/tokenizer_info``. SGLang: ``/generate``, ``/get_server_info``, ``/health``. Prometheus:
``/metrics``. The routes live in ``serve.routes`` (one module per family, one shared
generate-and-render path); errors map to HTTP in ``serve.routes.errors``; ``serve.middleware``
counts requests and checks the API key and the body size.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from needlescope import __version__
from needlescope.serve.connections import (
    ACCEPT_BACKLOG,
    ConnectionLimits,
    bind_listener,
    guarded_protocol,
    quiet_accept_errors,
)
from needlescope.serve.engine import Engine
from needlescope.serve.middleware import CountRequests, LimitBody, RequireApiKey
from needlescope.serve.routes import include_routes
from needlescope.serve.routes.errors import install as install_error_handlers
from needlescope.serve.routes.generation import Serving

__all__ = ["SHUTDOWN_GRACE_S", "create_app", "run_server"]

log = logging.getLogger("needlescope.serve")


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
    install_error_handlers(app)
    include_routes(app, Serving(engine))
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(LimitBody, limit=engine.cfg.max_body_bytes)
    app.add_middleware(RequireApiKey, api_key=engine.cfg.api_key)
    app.add_middleware(CountRequests, metrics=engine.metrics)
    _openapi_without_422(app)
    return app


def _openapi_without_422(app: FastAPI) -> None:
    """FastAPI documents 422 for every body; this server answers validation failures with 400
    (OpenAI's status), so the schema must not promise 422."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


SHUTDOWN_GRACE_S = 5.0
"""At SIGTERM/SIGINT, how long running requests have to finish before they are answered 503."""
_SEND_ERRORS_S = 2.0
"""Time left after the grace period for those 503s (and streams' error events) to be written
before uvicorn cancels what still runs."""


class _Server(uvicorn.Server):
    """uvicorn server that reports its bound port once it is listening, and on SIGTERM/SIGINT
    answers the requests still waiting for the engine 503 at once, and those still running after
    ``SHUTDOWN_GRACE_S`` 503 too (a stream: an error event, then the end of the stream), before
    uvicorn's own graceful window closes and it would drop their connections unanswered."""

    def __init__(
        self, config: uvicorn.Config, engine: Engine, on_ready: Callable[[str, int], None] | None
    ) -> None:
        super().__init__(config)
        self._engine = engine
        self._on_ready = on_ready
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        # A signal handler may interrupt the loop thread inside admission's lock: drain from the
        # loop's next turn instead of here.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._engine.drain)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(SHUTDOWN_GRACE_S, self._abort_running)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()

    def _abort_running(self) -> None:
        aborted = self._engine.abort_running()
        if aborted:
            log.warning(
                "shutting down: %d request(s) still running after %gs answered 503 shutting_down",
                aborted,
                SHUTDOWN_GRACE_S,
            )

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        quiet_accept_errors(self._loop)
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(host, port)


def run_server(
    engine: Engine,
    on_ready: Callable[[str, int], None] | None = None,
    listener: socket.socket | None = None,
) -> None:
    """Serve ``engine`` until SIGINT/SIGTERM on ``listener`` (``bind_listener``; default: bind
    ``cfg.host:cfg.port`` now); ``on_ready(host, port)`` runs once it listens."""
    app = create_app(engine)
    cfg = engine.cfg
    limits = ConnectionLimits.for_server(
        cfg.max_connections, cfg.header_timeout_s, cfg.body_timeout_s, cfg.half_close_timeout_s
    )
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        http=guarded_protocol(limits),
        backlog=ACCEPT_BACKLOG,
        timeout_keep_alive=5,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S + _SEND_ERRORS_S,
        lifespan="on",
    )
    sock = listener if listener is not None else bind_listener(cfg.host, cfg.port)
    _Server(config, engine, on_ready).run(sockets=[sock])
