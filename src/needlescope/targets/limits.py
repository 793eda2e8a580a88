"""What a target says about the needles it can take: the value length its checkpoint was trained
on and its context, read from the info endpoints ``collect_provenance`` already fetched.

Every command that sends needles (probe, compare, health, canary, engine-state, oracle) resolves
both here, so they agree: the value length is the one given on the command line, else the one the
target advertises (``/get_server_info``'s ``trained_value_digits``, which ``needlescope serve``
publishes), else the default; a prompt length fits when it and the answer's tokens fit the
context, and lengths that do not are refused before any needle is sent (``fit_lengths``).

Where the context comes from, first found wins: ``/get_server_info``'s ``context_length``
(needlescope serve, SGLang when set), ``/v1/models``' ``max_model_len`` (vLLM, SGLang, needlescope
serve) for the model asked for, ``/props``' ``default_generation_settings.n_ctx`` (llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

from needlescope.cases.needles import VALUE_DIGITS
from needlescope.errors import BadInput

__all__ = ["TRAINED_DIGITS_KEY", "TargetLimits", "choose_value_digits", "fit_lengths", "read_limits"]

# The key under which a server advertises the value length its checkpoint was trained on.
TRAINED_DIGITS_KEY = "trained_value_digits"


@dataclass(frozen=True)
class TargetLimits:
    """What the target advertises; ``None`` where it says nothing (each with where it was read)."""

    value_digits: int | None = None
    value_digits_from: str | None = None
    context: int | None = None
    context_from: str | None = None


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _context(provenance: dict, model: str | None) -> tuple[int | None, str | None]:
    info = provenance.get("/get_server_info")
    if isinstance(info, dict) and _positive_int(info.get("context_length")):
        return info["context_length"], "/get_server_info context_length"
    listing = provenance.get("/v1/models")
    rows = listing.get("data") if isinstance(listing, dict) else None
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and (model is None or row.get("id") == model):
            if _positive_int(row.get("max_model_len")):
                return row["max_model_len"], "/v1/models max_model_len"
    props = provenance.get("/props")
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    if isinstance(settings, dict) and _positive_int(settings.get("n_ctx")):
        return settings["n_ctx"], "/props n_ctx"
    return None, None


def read_limits(provenance: dict, model: str | None = None) -> TargetLimits:
    """The target's advertised value length and context from ``collect_provenance``'s dict."""
    info = provenance.get("/get_server_info")
    digits = _positive_int(info.get(TRAINED_DIGITS_KEY)) if isinstance(info, dict) else None
    if digits is not None and digits > 12:
        digits = None
    context, context_from = _context(provenance, model)
    return TargetLimits(
        value_digits=digits,
        value_digits_from=f"/get_server_info {TRAINED_DIGITS_KEY}" if digits is not None else None,
        context=context,
        context_from=context_from,
    )


def choose_value_digits(
    given: int | None, limits: TargetLimits, flag: str = "--value-digits"
) -> tuple[int, str]:
    """Digits per needle value and a phrase saying where that number came from."""
    if given is not None:
        return given, flag
    if limits.value_digits is not None:
        return limits.value_digits, f"the target's {limits.value_digits_from} (no {flag} given)"
    return VALUE_DIGITS, f"the default (no {flag} given; the target advertises no {TRAINED_DIGITS_KEY})"


def fit_lengths(
    lengths: tuple[int, ...],
    limits: TargetLimits,
    *,
    answer_tokens: int,
    skip: bool = False,
    flag: str = "--lengths",
    skip_flag: str = "--skip-long-lengths",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lengths that fit, lengths dropped). A length fits when it plus ``answer_tokens`` is at most
    the target's context; with no advertised context every length is kept. BadInput when one does
    not fit (unless ``skip``) or none does."""
    if limits.context is None:
        return tuple(lengths), ()
    room = limits.context - answer_tokens
    if room < 1:
        raise BadInput(
            f"--max-tokens {answer_tokens} leaves no room for a prompt: the target's context is "
            f"{limits.context} tokens ({limits.context_from}); pass a --max-tokens well under it"
        )
    kept = tuple(n for n in lengths if n <= room)
    dropped = tuple(n for n in lengths if n > room)
    if not dropped:
        return kept, ()
    where = (
        f"the target's context is {limits.context} tokens ({limits.context_from}), so a prompt "
        f"holds at most {room} with {answer_tokens} answer tokens"
    )
    too_long = ",".join(map(str, dropped))
    if not kept:
        raise BadInput(f"{flag} {too_long}: {where}; pass lengths up to {room}")
    if not skip:
        raise BadInput(f"{flag} {too_long}: {where}; pass lengths up to {room}, or {skip_flag} to drop them")
    return kept, dropped
