"""Prompt token counting, preferably by the server itself.

Counting with the server's own tokenizer and chat template gives exact prompt lengths. A local
``tokenizer.json`` is a fallback: it renders chat with a simple default template, so its counts may
differ from what the server sees. A run records both its own count and the server's
``usage.prompt_tokens`` so any difference is visible in the results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from needlescope.errors import BadInput, ProtocolViolation, TransportFailure

# The form that worked is remembered so later calls skip the probing.
_FORMS = ("vllm", "sglang", "llamacpp")


def _count_from(body: Any) -> int | None:
    if isinstance(body, dict):
        if isinstance(body.get("count"), int):
            return body["count"]
        for key in ("tokens", "input_ids"):
            if isinstance(body.get(key), list):
                return len(body[key])
    return None


@dataclass
class ServerTokenCounter:
    """Counts a chat's prompt tokens (with generation prompt) through the server's tokenize endpoint."""

    root: str
    model: str
    timeout: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    form: str | None = None
    transport: httpx.BaseTransport | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.root = self.root.rstrip("/")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.Client(headers=headers, timeout=self.timeout, transport=self.transport)

    def _post(self, path: str, payload: dict) -> Any:
        try:
            resp = self._client.post(self.root + path, json=payload)
        except httpx.TransportError as e:
            raise TransportFailure(f"{self.root}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise ProtocolViolation(f"{self.root}{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError as e:
            raise ProtocolViolation(f"{self.root}{path} answered invalid JSON: {resp.text[:200]!r}") from e

    def _vllm(self, messages: list[dict]) -> int | None:
        body = self._post(
            "/tokenize", {"model": self.model, "messages": messages, "add_generation_prompt": True}
        )
        return _count_from(body)

    def _sglang(self, messages: list[dict]) -> int | None:
        # SGLang has no chat-aware tokenize; its /v1/tokenize takes the same chat form where present.
        body = self._post(
            "/v1/tokenize", {"model": self.model, "messages": messages, "add_generation_prompt": True}
        )
        return _count_from(body)

    def _llamacpp(self, messages: list[dict]) -> int | None:
        templ = self._post("/apply-template", {"messages": messages})
        prompt = templ.get("prompt") if isinstance(templ, dict) else None
        if not isinstance(prompt, str):
            return None
        # The template already contains special tokens as text; parse them rather than adding BOS twice.
        return _count_from(self._post("/tokenize", {"content": prompt, "parse_special": True}))

    def __call__(self, messages: list[dict]) -> int:
        forms = [self.form] if self.form else list(_FORMS)
        errors: list[str] = []
        for form in forms:
            try:
                n = getattr(self, "_" + form)(messages)
            except (ProtocolViolation, TransportFailure) as e:
                errors.append(f"{form}: {e}")
                continue
            if n is not None:
                self.form = form
                return n
            errors.append(f"{form}: response had no count or tokens")
        raise ProtocolViolation(f"cannot count tokens at {self.root}: " + "; ".join(errors))

    def close(self) -> None:
        self._client.close()


def detect_server_tokenizer(
    root: str, model: str, *, api_key: str | None = None, timeout: float = 30.0
) -> ServerTokenCounter | None:
    """Return a counter bound to the first tokenize form the server answers, or None if it has none."""
    probe = [{"role": "user", "content": "hello"}]
    for form in _FORMS:
        counter = ServerTokenCounter(root, model, timeout=timeout, api_key=api_key, form=form)
        try:
            n = counter(probe)
        except (ProtocolViolation, TransportFailure):
            counter.close()
            continue
        if n > 0:
            return counter
        counter.close()
    return None


def default_chat_render(messages: list[dict]) -> str:
    """The local fallback template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``.

    It is not any real model's template, so local counts are approximate; the run also records the
    server's reported ``usage.prompt_tokens``.
    """
    parts = [f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


class LocalTokenCounter:
    """Counts tokens with a local HF ``tokenizer.json`` and :func:`default_chat_render`."""

    def __init__(self, path: str | Path, render: Callable[[list[dict]], str] = default_chat_render) -> None:
        from tokenizers import Tokenizer  # optional dependency, only needed for local counting

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise BadInput(f"tokenizer file {p} not found; pass a path to an HF tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise BadInput(f"{p} is not a valid HF tokenizer.json: {e}") from e
        self.path = p
        self.render = render

    def __call__(self, messages: list[dict]) -> int:
        return len(self._tok.encode(self.render(messages), add_special_tokens=False).ids)
