"""A synchronous ``/v1/completions`` client for token logprobs, and prompt token ids.

The logprob oracle and the engine-state factors need what chat does not give: the prompt's token
ids (``/tokenize``, else the prompt's tokens echoed back with ``echo``) and, per generated token,
its logprob and the top-k alternatives (the OpenAI completions ``logprobs`` object:
``tokens``, ``token_logprobs``, ``top_logprobs``). A server that answers without logprobs, or has
no completions route, is a ``BadInput`` naming the server: the caller cannot measure anything
there, and retrying will not help.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from needlescope.errors import AnswerTooLarge, BadInput, ProtocolViolation, TimedOut, TransportFailure
from needlescope.targets.bounded import OverLimit, sync_client
from needlescope.targets.endpoints import normalize_base_url

__all__ = ["CompletionsTarget", "Completion", "GenStep"]


@dataclass(frozen=True)
class GenStep:
    token: str
    logprob: float
    top: dict[str, float]


@dataclass(frozen=True)
class Completion:
    text: str
    steps: list[GenStep]
    finish_reason: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    usage: dict = field(default_factory=dict)
    """The answer's whole ``usage`` object (vendor extensions included; ``targets.serving_usage``
    reads the serving ones), {} when it had none."""


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class CompletionsTarget:
    """``/v1/completions`` and ``/tokenize`` of one server (``base_url`` is the root or ``/v1``)."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    timeout: float = 300.0
    transport: httpx.BaseTransport | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.root, self.v1 = normalize_base_url(self.base_url)
        self._client = sync_client(self.api_key, self.timeout, self.transport)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> CompletionsTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, url: str, payload: dict) -> httpx.Response:
        try:
            return self._client.post(url, json=payload)
        except httpx.TimeoutException as e:
            raise TimedOut(f"{url}: no complete answer within {self.timeout:g}s ({type(e).__name__})") from e
        except OverLimit as e:
            raise AnswerTooLarge(str(e)) from e
        except httpx.TransportError as e:
            raise TransportFailure(f"{url}: {type(e).__name__}: {e}") from e

    def tokenize(self, prompt: str) -> list[int] | None:
        """The prompt's token ids from ``/tokenize`` (vLLM, this project's server) or
        ``/v1/tokenize``; None when the server has neither."""
        for url in (self.root + "/tokenize", self.v1 + "/tokenize"):
            resp = self._post(url, {"model": self.model, "prompt": prompt})
            if resp.status_code in (404, 405):
                continue
            if resp.status_code != 200:
                raise ProtocolViolation(f"{url} answered HTTP {resp.status_code}: {resp.text[:200]}")
            body = resp.json()
            ids = body.get("tokens", body.get("input_ids")) if isinstance(body, dict) else None
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                return ids
            raise ProtocolViolation(f"{url} answered without token ids: {resp.text[:200]}")
        return None

    def complete(self, prompt: str, max_tokens: int, *, top: int = 20, echo: bool = False) -> Completion:
        """One greedy completion with ``top`` alternatives per token."""
        url = self.v1 + "/completions"
        payload = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": top,
            "echo": echo,
        }
        resp = self._post(url, payload)
        if resp.status_code in (404, 405):
            raise BadInput(
                f"{self.v1} has no /v1/completions (HTTP {resp.status_code}); the oracle needs a "
                "completions endpoint with logprobs (vLLM, SGLang and needlescope serve have one)"
            )
        if resp.status_code != 200:
            raise ProtocolViolation(f"{url} answered HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            body = resp.json()
            choice = body["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ProtocolViolation(f"{url} answered no completion choice: {resp.text[:300]}") from e
        lp = choice.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
            raise BadInput(
                f"{self.v1} answered /v1/completions without logprobs (asked for logprobs={top}); "
                "this server does not report token logprobs, so there is nothing to compare; "
                "use a server that does (vLLM, SGLang, needlescope serve)"
            )
        prompt_tokens, cached = _usage(body)
        steps = _steps(lp, url)
        return Completion(
            str(choice.get("text") or ""), steps, choice.get("finish_reason"), prompt_tokens, cached
        )

    def chat(
        self, messages: list[dict], max_tokens: int, *, top: int = 5, extra: dict | None = None
    ) -> Completion:
        """One greedy chat completion with ``top`` alternatives per token (the probe's request plus
        ``logprobs``); a server that answers without logprobs gets steps ``[]``. ``extra``: vendor
        request fields (a per-request serving knob such as a draft depth), sent as they are."""
        url = self.v1 + "/chat/completions"
        payload = {
            **(extra or {}),
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": top,
        }
        resp = self._post(url, payload)
        if resp.status_code != 200:
            raise ProtocolViolation(f"{url} answered HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            body = resp.json()
            choice = body["choices"][0]
            text = choice["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise ProtocolViolation(f"{url} answered no chat choice: {resp.text[:300]}") from e
        content = (choice.get("logprobs") or {}).get("content") or []
        steps = [
            GenStep(
                token=str(c.get("token")),
                logprob=float(c["logprob"]) if _num(c.get("logprob")) else float("nan"),
                top={
                    str(t.get("token")): float(t["logprob"])
                    for t in c.get("top_logprobs") or []
                    if _num(t.get("logprob"))
                },
            )
            for c in content
            if isinstance(c, dict)
        ]
        prompt_tokens, cached = _usage(body)
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        return Completion(str(text), steps, choice.get("finish_reason"), prompt_tokens, cached, usage)

    def echoed_prompt_tokens(self, prompt: str) -> list[str] | None:
        """The prompt's token texts as the server echoes them (the fallback without /tokenize);
        None when the server refuses ``echo``."""
        try:
            done = self.complete(prompt, 1, top=0, echo=True)
        except ProtocolViolation:
            return None
        n = done.prompt_tokens
        if n is None or n > len(done.steps):
            return None
        return [s.token for s in done.steps[:n]]


def _usage(body: dict) -> tuple[int | None, int | None]:
    """(prompt_tokens, prompt_tokens_details.cached_tokens) of a response, None where absent."""
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt_tokens = usage.get("prompt_tokens")
    return (
        prompt_tokens if isinstance(prompt_tokens, int) else None,
        cached if isinstance(cached, int) else None,
    )


def _steps(lp: dict, url: str) -> list[GenStep]:
    """Steps from an OpenAI completions ``logprobs`` object (an echoed prompt's first token has
    a null logprob; it is kept with logprob NaN so positions stay aligned)."""
    tokens, lps = lp.get("tokens") or [], lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    if not (len(tokens) == len(lps) == len(tops)):
        raise ProtocolViolation(
            f"{url}: logprobs lists differ in length ({len(tokens)}, {len(lps)}, {len(tops)})"
        )
    out = []
    for tok, val, top in zip(tokens, lps, tops, strict=True):
        if isinstance(top, list):  # the chat shape, [{"token", "logprob"}], which some servers send here too
            top = {t.get("token"): t.get("logprob") for t in top if isinstance(t, dict) and "token" in t}
        if not isinstance(top, (dict, type(None))):
            raise ProtocolViolation(
                f"{url}: a top_logprobs entry is {type(top).__name__}, not an object of token logprobs"
            )
        alts = {str(k): float(v) for k, v in (top or {}).items() if _num(v)}
        out.append(GenStep(token=str(tok), logprob=float(val) if _num(val) else float("nan"), top=alts))
    return out
