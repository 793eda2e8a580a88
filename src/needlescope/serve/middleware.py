"""Pure ASGI middleware of the server (``BaseHTTPMiddleware`` would hide client disconnects
from ``Request.is_disconnected``): request counting, the API key, the body-size limit.

Order, outermost first: ``CountRequests`` (so refusals are counted too), ``RequireApiKey``,
``LimitBody``. The key and the size are checked from the headers, before any body is read.
"""

from __future__ import annotations

import hmac

from needlescope.serve.metrics import ServeMetrics
from needlescope.serve.routes.errors import ApiError, error_response

__all__ = ["ROUTES", "CountRequests", "RequireApiKey", "LimitBody"]

ROUTES = (
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/v1/tokenize",
    "/detokenize",
    "/v1/detokenize",
    "/tokenizer_info",
    "/generate",
    "/health",
    "/get_server_info",
    "/version",
    "/metrics",
)
"""The ``endpoint`` label values of ``requests_total`` (plus ``/v1/models/{id}`` and ``other``)."""

OPEN_ROUTES = ("/health",)


def endpoint_label(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


class CountRequests:
    """Counts finished requests by route and status in ``requests_total``."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
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
            self.metrics.requests.labels(endpoint_label(scope.get("path", "")), str(status["code"])).inc()


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class RequireApiKey:
    """With a key set, every route but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope.get("path") not in OPEN_ROUTES:
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer KEY' with the server's --api-key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """Refuses a body over ``limit`` bytes with 413: from its Content-Length before reading it,
    or (chunked uploads) as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _refusal(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"request body of {size} bytes is over this server's limit of {self.limit} bytes (--max-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await error_response(ApiError(400, "Content-Length is not an integer"))(scope, receive, send)
                return
            if size > self.limit:
                await error_response(self._refusal(str(size)))(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read it all here, counting, then replay it to the app.
        messages, total = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.limit:
                await error_response(self._refusal(f"more than {self.limit}"))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
