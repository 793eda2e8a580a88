"""The one option group for probe-like flags: ``probe``, ``compare``, ``health`` and ``canary``.

A command names the config class it builds and which of these flags it takes
(``@option_group(ProbeConfig, PROBE_FLAGS)``); the decorator adds them to its signature with the
class's own field defaults (so the CLI never repeats a default as a literal), and the command
receives them as one ``flags`` dict that ``build`` turns into the config: lists and JSON parsed
here, every value validated by the config itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from needlescope.run.config import parse_extra_body, parse_float_list, parse_int_list

__all__ = ["API_KEY_ENV", "PROBE_FLAGS", "config_default", "option_group", "build"]

API_KEY_ENV = ["NEEDLESCOPE_API_KEY", "OPENAI_API_KEY"]
_FROM_CONFIG = object()


@dataclass(frozen=True)
class Flag:
    """One flag: the config field it sets, its name, help, CLI type and parser (text -> value)."""

    field: str
    flag: str
    help: str
    kind: Any = str
    parse: Callable[[str, str], Any] | None = None
    fixed_default: Any = _FROM_CONFIG
    """A default that is not the config's (None: 'not given', for flags parsed from text)."""


_FLAGS = (
    Flag("kind", "--kind", "single | multikey | multivalue | multiturn"),
    Flag("lengths", "--lengths", "Target prompt lengths in tokens.", parse=parse_int_list),
    Flag("depths", "--depths", "Needle depths in percent.", parse=parse_float_list),
    Flag("trials", "--trials", "Cases per length and depth.", int),
    Flag("seed", "--seed", "Case generation seed.", int),
    Flag("concurrency", "--concurrency", "Requests in flight.", int),
    Flag(
        "tokenizer",
        "--tokenizer",
        "'server' (its /tokenize), or the checkpoint's tokenizer directory (tokenizer.json + "
        "chat_template.jinja), or its tokenizer.json with the template beside it.",
    ),
    Flag("chat_template", "--chat-template", "With --tokenizer PATH: the chat template file.", Path),
    Flag(
        "extra_body",
        "--extra-body",
        "JSON object merged into each request unchanged.",
        parse=lambda text, _flag: parse_extra_body(text),
        fixed_default=None,
    ),
    Flag(
        "skip_long_lengths",
        "--skip-long-lengths/--refuse-long-lengths",
        "Drop, with a warning, lengths beyond the target's advertised context (default: refuse the run).",
        bool,
    ),
    Flag("threshold", "--threshold", "Recall threshold of the effective length.", float),
    Flag("max_tokens", "--max-tokens", "Answer tokens per request.", int),
    Flag("timeout_s", "--timeout", "Per-request timeout in seconds.", float),
    Flag(
        "retry_budget_s",
        "--retry-budget",
        "Seconds a request may retry while the server answers 429/503.",
        float,
    ),
    Flag("haystack_file", "--haystack-file", "Filler text to use instead of the generated one.", Path),
    Flag(
        "value_digits",
        "--value-digits",
        "Digits per needle value; default: the target's advertised trained_value_digits, else 7.",
        int,
    ),
    Flag(
        "api_key",
        "--api-key",
        "Bearer key for the server (else NEEDLESCOPE_API_KEY or OPENAI_API_KEY); sent on every request, "
        "never written anywhere.",
    ),
    Flag(
        "distractors", "--distractors", "Near-duplicate keys per prompt (default: multikey 4, others 0).", int
    ),
    Flag(
        "auto_difficulty",
        "--auto-difficulty/--no-auto-difficulty",
        "Raise distractors, then value length, until the (reference) target recalls below "
        "--difficulty-target; hold that difficulty (docs/graded.md).",
        bool,
    ),
    Flag(
        "difficulty_target", "--difficulty-target", "--auto-difficulty: reference recall to get below.", float
    ),
    Flag(
        "graded",
        "--graded/--no-graded",
        "Also score each gold answer teacher-forced (logprob, rank, margin; docs/graded.md).",
        bool,
    ),
    Flag("top_logprobs", "--top-logprobs", "--graded: alternatives asked for at each gold token.", int),
    Flag(
        "margin_threshold", "--margin-threshold", "--graded: answers won by less (nats) count as thin.", float
    ),
)
FLAGS = {f.field: f for f in _FLAGS}
PROBE_FLAGS = tuple(FLAGS)


def config_default(cls: type, name: str) -> Any:
    """A config field's default as the CLI shows it (tuples as comma-separated text)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = f.default
    if value is dataclasses.MISSING:
        value = None if f.default_factory is dataclasses.MISSING else f.default_factory()
    return ",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else value


def _parameter(cls: type, flag: Flag) -> inspect.Parameter:
    fixed = flag.fixed_default
    default = config_default(cls, flag.field) if fixed is _FROM_CONFIG else fixed
    extra = {"envvar": API_KEY_ENV, "show_default": False} if flag.field == "api_key" else {}
    option = typer.Option(default, flag.flag, help=flag.help, **extra)
    kind = flag.kind if default is not None or flag.kind is bool else flag.kind | None
    return inspect.Parameter(flag.field, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)


def option_group(cls: type, names: Sequence[str]) -> Callable:
    """Add the flags ``names`` (fields of ``cls``) to a command; it receives them as ``flags``."""
    params = [_parameter(cls, FLAGS[n]) for n in names]

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn).parameters.values() if p.name != "flags"]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            flags = {n: kwargs.pop(n) for n in names}
            return fn(flags=flags, **kwargs)

        command.__signature__ = inspect.Signature([*own, *params])  # type: ignore[attr-defined]
        return command

    return decorate


def build(cls: type, flags: dict, **fixed: Any) -> Any:
    """``cls(**fixed, **flags)`` with text flags parsed; a flag left at None keeps ``cls``'s default."""
    values = {}
    for name, value in flags.items():
        flag = FLAGS[name]
        if value is None:
            continue
        values[name] = flag.parse(value, flag.flag) if flag.parse is not None else value
    return cls(**fixed, **values)
