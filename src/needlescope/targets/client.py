"""Async OpenAI-compatible chat client with retries, and a sync preflight check."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from needlescope.errors import (
    AnswerTooLarge,
    BadInput,
    ContextOverflow,
    ProbeError,
    ProtocolViolation,
    TimedOut,
    TransportFailure,
)
from needlescope.targets.bounded import AsyncBoundedTransport, OverLimit, sync_client
from needlescope.targets.endpoints import auth_headers, normalize_base_url
from needlescope.targets.gate import AdaptiveGate

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# "Busy, come back later": retried within a time budget rather than a count, and a sign to send less.
REJECT_STATUSES = frozenset({429, 503})


@dataclass
class ChatResult:
    text: str
    reasoning: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    latency_s: float
    attempts: int
    base_url: str
    replica: str | None = None
    """The replica a router says served the request (a header or body field), if it says."""
    connection: str | None = None
    """The client end (``host:port``) of the TCP connection that carried the answered attempt: two
    requests with the same value in one run went over the same kept-alive connection."""


def _retry_after(resp: httpx.Response) -> float | None:
    """The ``Retry-After`` seconds an answer names: None without the header or for an HTTP date
    (rare from inference servers); 0 for a value that asks for no wait (negative, NaN), so the
    backoff's own floor applies (``ChatTarget._backoff``); infinity for a huge one."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return 0.0 if math.isnan(seconds) or seconds < 0 else seconds


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    return str(body)[:300]


# Headers and body fields in which routers and servers name the replica that answered.
_REPLICA_HEADERS = ("x-replica-id", "x-replica", "x-served-by", "x-worker-id", "x-backend-server")
_REPLICA_FIELDS = ("replica", "replica_id", "worker_id")


def _connection(resp: httpx.Response) -> str | None:
    # The bounded transport keeps the client address of the (pooled again) connection.
    addr = resp.extensions.get("client_addr")
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else None


def _replica(resp: httpx.Response, body: Any) -> str | None:
    for h in _REPLICA_HEADERS:
        if resp.headers.get(h):
            return resp.headers[h]
    if isinstance(body, dict):
        for f in _REPLICA_FIELDS:
            if isinstance(body.get(f), (str, int)) and not isinstance(body.get(f), bool):
                return str(body[f])
    return None


def _is_overflow(status: int, message: str) -> bool:
    low = message.lower()
    return status in (400, 413, 422) and any(w in low for w in ("context", "too long"))


def _parse(body: Any) -> tuple[str, str | None, str | None, int | None, int | None]:
    if not isinstance(body, dict):
        raise ProtocolViolation(f"chat completion is not a JSON object: {str(body)[:200]}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ProtocolViolation(f"chat completion has no choices: {json.dumps(body)[:200]}")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ProtocolViolation(f"chat completion choice has no message: {json.dumps(choices[0])[:200]}")
    text = _content(message.get("content"), choices[0])
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    details = (
        usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    )
    prompt_tokens = usage.get("prompt_tokens")
    cached = details.get("cached_tokens")
    return (
        str(text),
        None if reasoning is None else str(reasoning),
        choices[0].get("finish_reason"),
        prompt_tokens if _is_count(prompt_tokens) else None,
        cached if _is_count(cached) else None,
    )


def _is_count(value: Any) -> bool:
    # JSON true is an int to Python; a token count it is not.
    return isinstance(value, int) and not isinstance(value, bool)


def _content(content: Any, choice: dict) -> str:
    """The answer text of a message's ``content``: a string; null (no text: an empty answer); or
    a list of content parts (``{"type": "text", "text": ...}``), whose texts are joined. Anything
    else (a number, an object) is not an answer: a protocol violation, never a miss to score."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content
    ):
        return "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
    raise ProtocolViolation(
        f"chat completion message content is a JSON {type(content).__name__}, not text: {json.dumps(choice)[:200]}"
    )


def chat_payload(
    model: str, messages: list[dict], max_tokens: int, extra_body: dict | None
) -> dict[str, Any]:
    """The exact chat-completions body the probe sends (reproducer bundles store it verbatim)."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    # extra_body is passed through unchanged; it may deliberately override the defaults above.
    payload.update(extra_body or {})
    return payload


class ChatTarget:
    """Sends chat completions to one or more replicas of the same model.

    Requests go to the replica with the fewest requests in flight (ties broken round-robin), so
    uneven latency does not pile work on a slow replica.

    Retries: a rejection (429/503) is retried, honouring ``Retry-After`` (plus a little jitter),
    until ``retry_budget_s`` has passed since the request started; other 5xx and dropped
    connections get ``retries`` more attempts with full-jitter exponential backoff. Every
    rejection also lowers the number of requests the gate lets into flight (see AdaptiveGate).

    Limits (``targets.bounded``): each attempt must end, answer read, within ``timeout`` seconds;
    one that does not is a ``timeout`` error and is not retried (a target that trickles would
    otherwise hold the case for ``retries + 1`` timeouts). An answer over ``MAX_ANSWER_BYTES`` is
    a ``too_large`` error, not retried either.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 4,
        retry_budget_s: float = 60.0,
        concurrency: int = 64,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise BadInput("no --base-url given")
        bases = [normalize_base_url(u) for u in urls]
        self._roots = [root for root, _v1 in bases]
        self._v1 = [v1 for _root, v1 in bases]
        self.model = model
        self.timeout = timeout
        self.retries = max(0, retries)
        self.retry_budget_s = retry_budget_s
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.gate = AdaptiveGate(concurrency)
        self.rejections = 0
        self._in_flight = [0] * len(self._v1)
        self._rr = itertools.count()
        # One small client per request slot rather than one client with a big pool: httpcore scans
        # every pooled connection on each request and response, so a pool of C connections costs
        # O(C) per request (docs/perf.md has the profile). The gate keeps at most ``concurrency``
        # attempts in flight, so a free client is always on the stack; LIFO keeps connections warm.
        self._clients = [
            httpx.AsyncClient(
                headers=auth_headers(api_key),
                timeout=httpx.Timeout(timeout),
                transport=AsyncBoundedTransport(
                    timeout,
                    transport,
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=len(self._v1)),
                    secret=api_key,
                ),
            )
            for _ in range(self.gate.ceiling)
        ]
        self._free = list(self._clients)

    @property
    def base_urls(self) -> list[str]:
        return list(self._v1)

    def _pick(self) -> int:
        start = next(self._rr) % len(self._v1)
        order = [(start + i) % len(self._v1) for i in range(len(self._v1))]
        return min(order, key=lambda i: self._in_flight[i])

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1))
        if retry_after is not None:
            # The server's own estimate, plus a little jitter so waiting clients do not return in
            # step; never under half the exponential backoff (a server saying "0" again and again
            # must not be hammered), never over backoff_max (a huge value is not slept whole).
            wait = min(max(retry_after, ceiling / 2), self.backoff_max)
            return min(wait + random.uniform(0, 0.1 * wait + 0.01), self.backoff_max)
        # Full jitter: spreads retries of many concurrent requests instead of synchronising them.
        return random.uniform(0, ceiling)

    async def chat(
        self,
        messages: list[dict],
        *,
        max_tokens: int,
        extra_body: dict | None = None,
    ) -> ChatResult:
        """One chat completion. A ProbeError raised here carries ``attempts`` (requests sent)."""
        payload = chat_payload(self.model, messages, max_tokens, extra_body)
        start = time.monotonic()
        resp, url, v1, attempts = await self._send("/chat/completions", payload, at_root=False)
        try:
            return _result(resp, url, v1, start, attempts)
        except ProbeError as e:
            e.attempts = attempts
            raise

    async def post_json(self, path: str, payload: dict, *, at_root: bool = False) -> dict:
        """POST ``payload`` to ``path`` under an endpoint's /v1 (or its root), with the chat's
        retries and admission; the 200 answer's JSON object. Raises ProbeError as ``chat`` does."""
        resp, url, _v1, _attempts = await self._send(path, payload, at_root=at_root)
        try:
            body = resp.json()
        except ValueError as e:
            raise ProtocolViolation(f"{url} answered 200 with invalid JSON: {resp.text[:200]!r}") from e
        if not isinstance(body, dict):
            raise ProtocolViolation(f"{url} answered a JSON {type(body).__name__}, not an object")
        return body

    async def _send(self, path: str, payload: dict, *, at_root: bool) -> tuple[httpx.Response, str, str, int]:
        """(200 response, url, the endpoint's /v1 base, requests sent) from the least-busy endpoint."""
        idx = self._pick()
        v1 = self._v1[idx]
        url = (self._roots[idx] if at_root else v1) + path
        start = time.monotonic()
        self._in_flight[idx] += 1
        attempts = [0]
        try:
            return await self._attempts(url, payload, start, attempts), url, v1, attempts[0]
        except ProbeError as e:
            e.attempts = attempts[0]
            raise
        finally:
            self._in_flight[idx] -= 1

    async def _attempts(self, url: str, payload: dict, start: float, attempts: list[int]) -> httpx.Response:
        failures = 0  # non-rejection failures, limited by ``retries``
        while True:
            attempts[0] += 1
            retry_after: float | None = None
            rejected = False
            async with self.gate:
                client = self._free.pop()
                try:
                    resp = await client.post(url, json=payload)
                except httpx.TimeoutException as e:
                    raise TimedOut(
                        f"{url}: no complete answer within {self.timeout:g}s ({type(e).__name__})"
                    ) from None
                except OverLimit as e:
                    raise AnswerTooLarge(str(e)) from None
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                else:
                    if resp.status_code == 200:
                        self.gate.success()
                        return resp
                    message = _error_message(resp)
                    if _is_overflow(resp.status_code, message):
                        raise ContextOverflow(f"{url} refused the prompt ({resp.status_code}): {message}")
                    if resp.status_code not in RETRY_STATUSES:
                        raise ProtocolViolation(f"{url} answered HTTP {resp.status_code}: {message}")
                    last = f"HTTP {resp.status_code}: {message}"
                    retry_after = _retry_after(resp)
                    rejected = resp.status_code in REJECT_STATUSES
                finally:
                    self._free.append(client)
            if rejected:
                self.rejections += 1
                self.gate.rejected()
                delay = self._backoff(attempts[0], retry_after)
                if time.monotonic() - start + delay > self.retry_budget_s:
                    raise TransportFailure(
                        f"{url} kept rejecting for {time.monotonic() - start:.1f}s ({attempts[0]} attempts, "
                        f"retry budget {self.retry_budget_s:g}s); last: {last}"
                    )
            else:
                failures += 1
                if failures > self.retries:
                    raise TransportFailure(f"{url} failed after {attempts[0]} attempts; last: {last}")
                delay = self._backoff(failures, retry_after)
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    async def __aenter__(self) -> ChatTarget:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _result(resp: httpx.Response, url: str, v1: str, start: float, attempts: int) -> ChatResult:
    try:
        body = resp.json()
    except ValueError as e:
        raise ProtocolViolation(f"{url} answered 200 with invalid JSON: {resp.text[:200]!r}") from e
    text, reasoning, finish, ptok, cached = _parse(body)
    return ChatResult(
        text=text,
        reasoning=reasoning,
        finish_reason=finish,
        prompt_tokens=ptok,
        cached_tokens=cached,
        latency_s=time.monotonic() - start,
        attempts=attempts,
        base_url=v1,
        replica=_replica(resp, body),
        connection=_connection(resp),
    )


def _unreachable(v1: str, e: httpx.TransportError, flag: str) -> BadInput:
    """The one line for a server nothing answers at (``flag``: the option that named it)."""
    return BadInput(f"cannot reach {v1}: {_reason(e)}; is the server running? check {flag}")


def _reason(e: httpx.TransportError) -> str:
    text = str(e).lower()
    if "refused" in text:
        return "connection refused"
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    if "name or service" in text or "nodename" in text or "resolve" in text:
        return "host name not found"
    return f"{type(e).__name__}: {e}"


def _model_ids(resp: httpx.Response) -> list[str] | None:
    """The ids of an OpenAI model list, or None when the answer is not one."""
    if resp.status_code != 200:
        return None
    try:
        return [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return None


def served_models(
    base_url: str, api_key: str | None = None, timeout: float = 5, *, flag: str | None = None
) -> list[str] | None:
    """The model ids ``/v1/models`` lists, or None when it lists none or cannot be read. Given
    ``flag`` (the option that named the server), a server nothing answers at is BadInput instead,
    as in ``preflight``: a caller that needs the list must not read "unreachable" as "none listed"."""
    _root, v1 = normalize_base_url(base_url)
    try:
        with sync_client(api_key, timeout) as client:
            return _model_ids(client.get(v1 + "/models")) or None
    except httpx.TransportError as e:
        if flag is not None:
            raise _unreachable(v1, e, flag) from None
        return None


def preflight(
    base_url: str,
    model: str,
    api_key: str | None = None,
    timeout: float = 5,
    *,
    transport: httpx.BaseTransport | None = None,
    flag: str = "--base-url",
    model_flag: str = "--model",
) -> list[str]:
    """Check the server is reachable, serves ``model`` and has chat completions.

    Returns what had to be assumed (empty when ``/v1/models`` lists ``model``): some servers
    (transformers serve) list nothing or fail ``/v1/models`` yet chat fine, so when the list does
    not show ``model`` a one-token chat with it decides. Raises BadInput with one line saying what
    is wrong and what to do (``flag``: the option that named this server, e.g. compare's ``--b``;
    ``model_flag``: the one that named ``model``).
    """
    _root, v1 = normalize_base_url(base_url)
    with sync_client(api_key, timeout, transport) as client:
        try:
            resp = client.get(v1 + "/models")
        except httpx.TransportError as e:
            raise _unreachable(v1, e, flag) from None
    if resp.status_code in (401, 403):
        raise BadInput(f"{v1}/models answered HTTP {resp.status_code}; check --api-key")
    ids = _model_ids(resp)
    # A new connection: uvicorn closes one after an unhandled 500 (transformers serve's /v1/models
    # offline), and reusing it races that close ("connection reset by peer").
    with sync_client(api_key, timeout, transport) as client:
        try:
            chat = client.post(
                v1 + "/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1},
            )
        except httpx.TransportError as e:
            raise BadInput(f"cannot reach {v1}/chat/completions: {_reason(e)}; check {flag}") from None
    if chat.status_code in (401, 403):
        raise BadInput(f"{v1}/chat/completions answered HTTP {chat.status_code}; check --api-key")
    if ids is not None and model in ids:
        if chat.status_code in (404, 405):
            raise BadInput(
                f"{v1} has no chat completions endpoint (HTTP {chat.status_code}); needlescope needs /v1/chat/completions"
            )
        return []
    listing = (
        f"{v1}/models listed no models"
        if ids == []
        else f"{v1}/models did not list {model!r}"
        if ids
        else f"{v1}/models answered HTTP {resp.status_code} without a model list"
    )
    if chat.status_code == 200:
        return [f"{listing}; a one-token chat with {model!r} worked, so it is assumed to be served"]
    if ids:
        raise BadInput(f"model {model!r} not served at {v1}; available: {', '.join(ids)}")
    raise BadInput(
        f"{listing}, and a one-token chat with {model!r} failed (HTTP {chat.status_code}: "
        f"{_error_message(chat)[:120]}); check {flag} and {model_flag}"
    )
