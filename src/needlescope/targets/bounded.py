"""Every request to a target ends within its deadline and reads at most a bounded answer.

httpx's ``timeout`` bounds each socket operation, not the request: a target that trickles one
byte a second never trips it, and a target that streams without end is read until memory runs
out. The transports here wrap the real one and hold each request to two limits:

- **deadline**: connect, send, headers and the whole body within ``deadline_s`` seconds
  (``--timeout``; a request's own ``timeout=`` overrides it). Past it the request fails with ``httpx.ReadTimeout``, which every client maps
  to a ``timeout`` error. The async transport cancels the request (``asyncio.timeout``); the sync
  one clips every socket operation to the time left (a network backend that reads the deadline
  from a context variable), so a byte-a-second trickle in the headers stops too.
- **size**: at most ``max_bytes`` (``MAX_ANSWER_BYTES``, 8 MiB: a chat answer, a logprob table
  or a model list is far smaller) of body; past it ``OverLimit``, a ``too_large`` error.

Given the API key (``secret``, at least ``SCRUB_MIN_CHARS`` long), a transport also takes it out
of every body it reads: a server that echoes the request's ``Authorization`` header (in an
error, an answer, its own launch command) must not put the key into results, bundles, logs or
messages, which quote what the server said.

The body is read inside the transport, so a caller always gets a complete, bounded response.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextvars import ContextVar

import httpcore
import httpx

from needlescope.targets.endpoints import REDACTED, auth_headers, tls_context

__all__ = [
    "MAX_ANSWER_BYTES",
    "OverLimit",
    "AsyncBoundedTransport",
    "BoundedTransport",
    "async_client",
    "sync_client",
]

MAX_ANSWER_BYTES = 8 * 1024 * 1024
"""The largest answer body a client reads from a target (bytes)."""


class OverLimit(httpx.TransportError):
    """The target's answer passed ``MAX_ANSWER_BYTES``; the rest was not read."""


def _too_large(request: httpx.Request, limit: int) -> OverLimit:
    return OverLimit(
        f"the answer from {request.url} passed {limit} bytes (needlescope reads at most that much)",
        request=request,
    )


def _deadline_error(request: httpx.Request, deadline_s: float) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(
        f"no complete answer within {deadline_s:g}s (the whole request)", request=request
    )


def _deadline_of(request: httpx.Request, default: float) -> float:
    """A request's own read timeout (``client.get(url, timeout=...)``) is its deadline."""
    read = request.extensions.get("timeout", {}).get("read")
    return default if read is None else read


def client_addr(resp: httpx.Response) -> tuple | None:
    """The client end of the connection ``resp`` came over, read while it is open (None: no socket,
    as under a test transport)."""
    stream = resp.extensions.get("network_stream")
    return stream.get_extra_info("client_addr") if stream is not None else None


SCRUB_MIN_CHARS = 8
"""A shorter key (``EMPTY``, ``1``) is no secret, and taking it out of answers would change them
(a needle's value holds digits); it is not scrubbed."""


def _scrub(body: bytes, secret: str | None) -> bytes:
    """``body`` without the key (as it is, and as JSON writes it when it holds ``"`` or ``\\``)."""
    if not secret or len(secret) < SCRUB_MIN_CHARS:
        return body
    for form in {secret, json.dumps(secret)[1:-1]}:
        body = body.replace(form.encode(), REDACTED.encode())
    return body


def _bounded_response(
    resp: httpx.Response,
    body: bytes,
    request: httpx.Request,
    addr: tuple | None = None,
    secret: str | None = None,
) -> httpx.Response:
    # The body is already decoded (the cap counts decoded bytes, so a compressed bomb stops too).
    body = _scrub(body, secret)
    drop = ("content-encoding", "content-length", "transfer-encoding")
    headers = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in drop]
    # The connection has gone back to the pool: keep which one it was (probe results record it).
    extensions = {"client_addr": addr} if addr is not None else {}
    return httpx.Response(
        resp.status_code, headers=headers, content=body, request=request, extensions=extensions
    )


class AsyncBoundedTransport(httpx.AsyncBaseTransport):
    """``inner`` (a verifying HTTP transport by default) under a deadline and a size cap."""

    def __init__(
        self,
        deadline_s: float,
        inner: httpx.AsyncBaseTransport | None = None,
        *,
        max_bytes: int = MAX_ANSWER_BYTES,
        limits: httpx.Limits | None = None,
        secret: str | None = None,
    ) -> None:
        self.deadline_s = deadline_s
        self.max_bytes = max_bytes
        self._secret = secret
        self._inner = inner or httpx.AsyncHTTPTransport(verify=tls_context(), limits=limits or httpx.Limits())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        deadline_s = _deadline_of(request, self.deadline_s)
        try:
            async with asyncio.timeout(deadline_s):
                resp = await self._inner.handle_async_request(request)
                addr = client_addr(resp)
                try:
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > self.max_bytes:
                            raise _too_large(request, self.max_bytes)
                finally:
                    await resp.aclose()
        except TimeoutError:
            raise _deadline_error(request, deadline_s) from None
        return _bounded_response(resp, bytes(body), request, addr, self._secret)

    async def aclose(self) -> None:
        await self._inner.aclose()


# The monotonic time by which the current sync request must end (None: no request in progress).
_DEADLINE: ContextVar[float | None] = ContextVar("needlescope_request_deadline", default=None)


def _clip(timeout: float | None) -> float | None:
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clip(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clip(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _clip(timeout)))

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = self._inner.connect_tcp(host, port, _clip(timeout), local_address, socket_options)
        return _DeadlineStream(stream)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._inner.connect_unix_socket(path, _clip(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class BoundedTransport(httpx.BaseTransport):
    """The sync form: ``inner`` (a verifying HTTP transport by default) under a deadline and a
    size cap. A given ``inner`` (a test's ``MockTransport``) gets the size cap and the deadline
    checked between body chunks; the default one has every socket operation clipped to it."""

    def __init__(
        self,
        deadline_s: float,
        inner: httpx.BaseTransport | None = None,
        *,
        max_bytes: int = MAX_ANSWER_BYTES,
        secret: str | None = None,
    ) -> None:
        self.deadline_s = deadline_s
        self.max_bytes = max_bytes
        self._secret = secret
        if inner is None:
            inner = httpx.HTTPTransport(verify=tls_context())
            # httpx builds its pool without a network-backend argument; the pool reads this
            # attribute on each new connection (httpcore's pool API, pinned in constraints.txt).
            pool = inner._pool
            pool._network_backend = _DeadlineBackend(pool._network_backend)
        self._inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline_s = _deadline_of(request, self.deadline_s)
        end = time.monotonic() + deadline_s
        token = _DEADLINE.set(end)
        try:
            resp = self._inner.handle_request(request)
            try:
                body = bytearray()
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise _too_large(request, self.max_bytes)
                    if time.monotonic() > end:
                        raise _deadline_error(request, deadline_s)
            finally:
                resp.close()
        except httpx.TimeoutException as e:
            if time.monotonic() >= end - 0.01:
                raise _deadline_error(request, deadline_s) from e
            raise
        finally:
            _DEADLINE.reset(token)
        return _bounded_response(resp, bytes(body), request, secret=self._secret)

    def close(self) -> None:
        self._inner.close()


def sync_client(
    api_key: str | None, timeout: float, transport: httpx.BaseTransport | None = None
) -> httpx.Client:
    """The plain (non-chat) client of every sync request to the target: its auth, and ``timeout``
    as the whole request's deadline."""
    return httpx.Client(
        headers=auth_headers(api_key),
        timeout=timeout,
        transport=BoundedTransport(timeout, transport, secret=api_key),
    )


def async_client(
    api_key: str | None, timeout: float, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The async form of ``sync_client`` (watch's GETs, the SGLang capture client)."""
    return httpx.AsyncClient(
        headers=auth_headers(api_key),
        timeout=timeout,
        transport=AsyncBoundedTransport(timeout, transport, secret=api_key),
    )
