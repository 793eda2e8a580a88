"""One watch probe, built from the probe's own parts: its cases, its chat client, its scoring.

What watching adds is what a single request can tell about the server:

- ``RecordingTransport`` sits under ``targets.ChatTarget`` and notes each answer's HTTP status or
  the transport failure, so an error gets its kind from facts, not from message text. When the
  server streams (the canary asks for ``stream: true``) it notes the time to the first token and
  hands ChatTarget the assembled completion, so the client parses it as it parses any answer.
- ``error_kind`` names what went wrong: ``timeout``, ``connection``, ``admission`` (429 or 503,
  the engine refused to queue it), ``5xx``, or ``protocol`` (any other refusal or a bad body).
- ``check_server`` and ``resolve_model`` are the two GETs health and canary share; ``watch_client``
  makes those GETs and ``probe_target`` sends the chat probes, both with the key's header.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from needlescope.cases import Case, CaseSpec, build_cases, score_answer
from needlescope.cases.scoring import prompt_rivals
from needlescope.errors import BadInput, ProbeError
from needlescope.targets import ChatTarget, LocalTokenCounter, collect_provenance, detect_server_tokenizer
from needlescope.targets.bounded import MAX_ANSWER_BYTES, OverLimit, async_client
from needlescope.targets.limits import TargetLimits, read_limits
from needlescope.watch.config import TargetConfig

__all__ = [
    "ERROR_KINDS",
    "STREAM_BODY",
    "Outcome",
    "RecordingTransport",
    "build_probe_cases",
    "check_server",
    "close_counter",
    "error_kind",
    "probe_case",
    "probe_target",
    "resolve_model",
    "target_limits",
    "token_counter",
    "watch_client",
]

ERROR_KINDS = ("timeout", "connection", "admission", "5xx", "protocol", "too_large", "tokenize")
"""What failed; ``tokenize`` (never from ``error_kind``): the canary could build no probe, since
the server's token counting failed."""
# What the canary merges into each chat request to see the first token arrive.
STREAM_BODY = {"stream": True, "stream_options": {"include_usage": True}}


def watch_client(cfg: TargetConfig, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The client of the plain GETs (``/health``, ``/v1/models``, the engine's ``/metrics``)."""
    return async_client(cfg.api_key, cfg.timeout_s, transport)


def probe_target(v1: str, model: str, cfg: TargetConfig, transport: RecordingTransport) -> ChatTarget:
    """The chat client a watch probe goes through. It never retries and never waits out a 503:
    a refusal is an observation here, not something to wait out."""
    return ChatTarget(
        v1,
        model,
        api_key=cfg.api_key,
        timeout=cfg.timeout_s,
        retries=0,
        retry_budget_s=0,
        transport=transport,
    )


class RecordingTransport(httpx.AsyncBaseTransport):
    """Forwards to a real transport; keeps the last status, failure and time to first token."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = inner or httpx.AsyncHTTPTransport()
        self.status: int | None = None
        self.failure: httpx.TransportError | None = None
        self.ttft_s: float | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.status, self.failure, self.ttft_s = None, None, None
        start = time.monotonic()
        try:
            resp = await self._inner.handle_async_request(request)
            self.status = resp.status_code
            if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith(
                "text/event-stream"
            ):
                return resp
            try:
                body = await self._assemble(resp, start)
            finally:
                await resp.aclose()
        except httpx.TransportError as e:
            self.failure = e
            raise
        return httpx.Response(200, json=body, request=request)

    async def _assemble(self, resp: httpx.Response, start: float) -> dict:
        """The chat.completion object an SSE stream of chat.completion.chunk objects adds up to.

        A stream that reports an error, ends without a completion chunk, or ends with neither a
        ``finish_reason`` nor ``[DONE]`` (cut off: its answer may be incomplete) becomes a body
        without choices, which ChatTarget refuses as a protocol violation: a failed request,
        never a miss.
        """
        text: list[str] = []
        seen = done = False
        reasoning: list[str] = []
        finish = None
        usage = None
        buffer = ""
        size = 0
        async for piece in resp.aiter_raw():
            size += len(piece)
            if size > MAX_ANSWER_BYTES:
                raise OverLimit(f"the stream passed {MAX_ANSWER_BYTES} bytes", request=resp.request)
            buffer += piece.decode("utf-8", errors="replace")
            *lines, buffer = buffer.split("\n")
            for line in lines:
                data = line.strip()
                if not data.startswith("data:"):
                    continue
                data = data[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    return {"error": f"invalid SSE chunk: {data[:100]}"}
                if not isinstance(chunk, dict) or "error" in chunk:
                    return {"error": f"the stream reported an error: {data[:200]}"}
                choices = chunk.get("choices") or []
                if not isinstance(choices, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("delta") or {}, dict) for c in choices
                ):
                    return {"error": f"the stream sent a chunk without choice deltas: {data[:200]}"}
                seen = seen or bool(choices)
                usage = chunk.get("usage") or usage
                for choice in choices:
                    delta = choice.get("delta") or {}
                    for part, sink in (
                        (delta.get("content"), text),
                        (delta.get("reasoning_content"), reasoning),
                    ):
                        if part and not isinstance(part, str):
                            # Not text (a number, an object): a protocol error, never a miss or a crash.
                            return {"error": f"the stream sent content that is not text: {data[:200]}"}
                        if part:
                            if self.ttft_s is None:
                                self.ttft_s = time.monotonic() - start
                            sink.append(part)
                    finish = choice.get("finish_reason") or finish
        if not seen:
            return {"error": "the stream ended without a completion chunk"}
        if finish is None and not done:
            return {"error": "the stream was cut off: it ended with neither a finish_reason nor [DONE]"}
        message = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        return {"choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}


def error_kind(status: int | None, failure: BaseException | None) -> str:
    """One of ``ERROR_KINDS`` for a request that answered ``status`` or failed with ``failure``."""
    if isinstance(failure, httpx.TimeoutException):
        return "timeout"
    if isinstance(failure, OverLimit):
        return "too_large"
    if failure is not None:
        return "connection"
    if status in (429, 503):
        return "admission"
    if status is not None and status >= 500:
        return "5xx"
    return "protocol"


@dataclass(frozen=True)
class Outcome:
    """What one request showed: scored (``correct`` set) or failed (``error`` set, never a miss)."""

    correct: bool | None
    error: str | None
    detail: str
    e2e_s: float
    ttft_s: float | None = None
    answer: str = ""


async def probe_case(
    target: ChatTarget, recorder: RecordingTransport, case: Case, *, max_tokens: int, extra_body: dict
) -> Outcome:
    """Send ``case`` once (no retries: a failure is an observation) and score the answer."""
    start = time.monotonic()
    try:
        result = await target.chat(case.messages, max_tokens=max_tokens, extra_body=extra_body)
    except ProbeError as e:
        # The client's own limits (deadline, size) are raised above the recorder: their kind wins.
        kind = e.kind if e.kind in ("timeout", "too_large") else error_kind(recorder.status, recorder.failure)
        return Outcome(None, kind, str(e), time.monotonic() - start, recorder.ttft_s)
    # a hedge over the distractors is a miss, as in the probe (cases.scoring)
    correct = score_answer(result.text, case.expected, prompt_rivals(case.messages, case.expected))
    return Outcome(
        correct, None, "hit" if correct else "miss", result.latency_s, recorder.ttft_s, result.text
    )


def target_limits(cfg: TargetConfig, root: str, v1: str, model: str | None) -> tuple[TargetLimits, dict]:
    """What the target advertises (blocking GETs of its info endpoints) and the provenance read."""
    provenance = collect_provenance(root, v1, api_key=cfg.api_key, timeout=min(cfg.timeout_s, 5.0))
    return read_limits(provenance, model), provenance


async def check_server(client: httpx.AsyncClient, root: str, v1: str) -> Outcome:
    """GET ``/health``, or ``/v1/models`` where the server has no ``/health``; 200 means up."""
    start = time.monotonic()
    path = "/health"
    try:
        resp = await client.get(root + path)
        if resp.status_code in (404, 405):
            path = "/v1/models"
            resp = await client.get(v1 + "/models")
    except httpx.TransportError as e:
        kind = error_kind(None, e)
        return Outcome(None, kind, f"GET {path}: {kind} ({type(e).__name__})", time.monotonic() - start)
    elapsed = time.monotonic() - start
    if resp.status_code != 200:
        return Outcome(None, error_kind(resp.status_code, None), f"GET {path} {resp.status_code}", elapsed)
    return Outcome(True, None, f"GET {path} 200", elapsed)


async def resolve_model(client: httpx.AsyncClient, v1: str, model: str | None) -> str:
    """``model``, checked against what ``/v1/models`` lists, or the first id it lists when
    ``model`` is None. BadInput when ``model`` is not among the listed ids (a typo: exit 2, as
    the probe says it) or nothing names a model; httpx errors pass through. A server whose model
    list cannot be read is taken at its word for a given ``model``."""
    resp = await client.get(v1 + "/models")
    try:
        ids = [m["id"] for m in resp.json()["data"]] if resp.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        ids = []
    # Only a non-empty string names a model: an id of null or 123 was taken as the model, sent as
    # "model": null, and broke health's report with a traceback (its schema wants a string).
    ids = [i for i in ids if isinstance(i, str) and i]
    if model:
        if ids and model not in ids:
            raise BadInput(f"model {model!r} not served at {v1}; available: {', '.join(map(str, ids))}")
        return model
    if not ids:
        raise BadInput(f"{v1}/models lists no model (HTTP {resp.status_code}); pass --model")
    return ids[0]


def token_counter(cfg: TargetConfig, root: str, model: str):
    """What counts a request's tokens: the server's ``/tokenize`` (BadInput where it has none) or
    a local ``tokenizer.json``; blocking. The caller closes it (``close()``, where it has one)."""
    if cfg.tokenizer != "server":
        return LocalTokenCounter(Path(cfg.tokenizer))
    # --timeout bounds these requests too (never above the counter's own 30 s): without it a hung
    # /tokenize held `health --timeout 3`, a readiness probe, for a minute (30 s a form tried).
    counter = detect_server_tokenizer(root, model, api_key=cfg.api_key, timeout=min(cfg.timeout_s, 30.0))
    if counter is None:
        raise BadInput(
            f"the server at {root} exposes no /tokenize endpoint; pass --tokenizer PATH to a tokenizer.json"
        )
    return counter


def close_counter(counter) -> None:
    if hasattr(counter, "close"):
        counter.close()


def build_probe_cases(
    cfg: TargetConfig,
    root: str,
    model: str,
    *,
    lengths: tuple[int, ...],
    depths: tuple[float, ...],
    trials: int,
    value_digits: int,
    counter=None,
) -> list[Case]:
    """Exact-length cases as the probe builds them (blocking: it counts tokens through the server).
    ``counter`` (``token_counter``) is used and left open when given; else one is made and closed."""
    own = counter is None
    if own:
        counter = token_counter(cfg, root, model)
    spec = CaseSpec(
        kind=cfg.kind,
        lengths=lengths,
        depths=depths,
        trials=trials,
        seed=cfg.seed,
        max_answer_tokens=cfg.max_tokens,
        value_digits=value_digits,
    )
    try:
        return build_cases(spec, counter)
    finally:
        if own:
            close_counter(counter)
