"""Prompt token counting, preferably by the server itself.

Counting with the server's own tokenizer and chat template gives exact prompt lengths. For servers
without a tokenize endpoint, a local copy of the checkpoint's tokenizer and chat template does the
same offline. A run records both its own count and the server's ``usage.prompt_tokens``, so any
difference is flagged in the results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from needlescope.errors import BadInput, ProtocolViolation, TimedOut, TransportFailure
from needlescope.paths import read_json_object
from needlescope.targets.bounded import sync_client

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
        self._client = sync_client(self.api_key, self.timeout, self.transport)

    def _post(self, path: str, payload: dict) -> Any:
        try:
            resp = self._client.post(self.root + path, json=payload)
        except httpx.TimeoutException as e:
            raise TimedOut(
                f"{self.root}{path}: no answer within {self.timeout:g}s ({type(e).__name__})"
            ) from e
        except httpx.TransportError as e:
            raise TransportFailure(f"{self.root}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code == 429 or resp.status_code >= 500:
            # The endpoint exists but could not answer now: not the same as having none.
            raise TransportFailure(f"{self.root}{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
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
            except TransportFailure as e:
                if len(forms) == 1:
                    raise
                errors.append(f"{form}: {e}")
                continue
            except ProtocolViolation as e:
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
    """Return a counter bound to the first tokenize form the server answers, or None if it has none.

    A form that exists but failed (HTTP 429/5xx, a timeout, a dropped connection) is not "none":
    when no form answers and one of them failed that way, BadInput says so.
    """
    probe = [{"role": "user", "content": "hello"}]
    failures: list[str] = []
    for form in _FORMS:
        counter = ServerTokenCounter(root, model, timeout=timeout, api_key=api_key, form=form)
        try:
            n = counter(probe)
        except ProtocolViolation:
            counter.close()
            continue
        except TransportFailure as e:
            counter.close()
            if isinstance(e.__cause__, httpx.ConnectError):  # nothing answers: no form will
                raise BadInput(
                    f"cannot reach the server at {root} ({e}); is it running? check --base-url"
                ) from None
            failures.append(str(e))
            continue
        if n > 0:
            _check_grows(
                counter,
                n,
                f"the server's tokenize endpoint at {root} ({form} form)",
                "pass --tokenizer PATH to the checkpoint's tokenizer directory",
            )
            return counter
        counter.close()
    if failures:
        raise BadInput(
            f"the server at {root} has a tokenize endpoint but it failed: {failures[0]}; "
            "retry when the server answers, or pass --tokenizer PATH to a tokenizer.json"
        )
    return None


def _check_grows(counter, short: int, what: str, hint: str) -> None:
    """BadInput unless a chat of 100 more words counts more tokens than ``short`` (the count of
    one word): cases are fitted to a length by growing their filler until the count reaches it,
    and a count that does not grow with the text never does (the search doubled the filler
    without end). A template that leaves out the messages' content counts like that, and so does
    a tokenize endpoint that does not count what it is sent."""
    longer = counter([{"role": "user", "content": "hello " + "word " * 100}])
    if longer <= short:
        close = getattr(counter, "close", None)
        if close is not None:
            close()
        raise BadInput(
            f"{what} counts {short} tokens for a one-word chat and {longer} for a 100-word one: it does "
            f"not count the messages' text, so no prompt can be fitted to a length; {hint}"
        )


_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_json(path: Path) -> dict:
    return read_json_object(path, "pass the checkpoint's tokenizer directory")


class LocalTokenCounter:
    """Counts a chat's prompt tokens offline, as the server would: the checkpoint's own chat template
    (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) rendered with the
    generation prompt, then encoded by its ``tokenizer.json`` without adding special tokens again.

    ``path`` is a tokenizer directory or a ``tokenizer.json`` whose template sits beside it;
    ``chat_template`` names the template file explicitly. Rendering follows transformers'
    ``apply_chat_template``: a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``,
    ``raise_exception`` and the special tokens of ``tokenizer_config.json`` as variables.
    """

    def __init__(self, path: str | Path, chat_template: str | Path | None = None) -> None:
        from tokenizers import Tokenizer  # optional dependency, only needed for local counting

        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise BadInput(
                f"--tokenizer {path}: no tokenizer.json there; pass the checkpoint's tokenizer directory "
                "or its tokenizer.json"
            )
        try:
            self._tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise BadInput(f"{tok_file} is not a valid HF tokenizer.json: {e}") from None
        folder = tok_file.parent
        config_file = folder / "tokenizer_config.json"
        config = _load_json(config_file) if config_file.is_file() else {}
        if chat_template is not None:
            template_file: Path | None = Path(chat_template)
            if not template_file.is_file():
                raise BadInput(f"--chat-template {chat_template} is not a file; pass a chat_template.jinja")
            source = template_file.read_text(encoding="utf-8")
        elif (folder / _TEMPLATE_FILE).is_file():
            template_file = folder / _TEMPLATE_FILE
            source = template_file.read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template_file, source = config_file, config["chat_template"]
        else:
            raise BadInput(
                f"no chat template beside {tok_file} (neither {_TEMPLATE_FILE} nor a chat_template in "
                "tokenizer_config.json); pass --chat-template FILE so counts include the template"
            )
        self.path = tok_file
        self.template_path = template_file
        self._specials = {k: v for k in _SPECIAL_KEYS if (v := _special(config.get(k))) is not None}
        self._template = _compile(source, template_file)
        _check_grows(
            self,
            self([{"role": "user", "content": "hello"}]),
            f"the chat template {template_file}",
            "pass the checkpoint's own template (--chat-template FILE)",
        )

    def render(self, messages: list[dict]) -> str:
        """The prompt text the server's tokenizer sees (with the generation prompt)."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._specials)
        except TemplateError as e:
            raise BadInput(f"the chat template {self.template_path} cannot render this chat: {e}") from None

    def __call__(self, messages: list[dict]) -> int:
        return len(self._tok.encode(self.render(messages), add_special_tokens=False).ids)


def _compile(source: str, where: Path):
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with the dev and model extras
        raise BadInput("counting with --tokenizer PATH needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise BadInput(f"{where} is not a valid Jinja chat template: {e}") from None
