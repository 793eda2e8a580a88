"""Per-request decoding settings: validated once (``make_sampling``), applied per row (``pick``).

Validation raises engine errors (``BadValue`` naming the engine's field, ``ContextOverflow``);
the HTTP layer renames fields to what the client sent. Conventions follow vLLM/SGLang:

- a temperature below ``GREEDY_EPS`` is greedy (so 1e-40 cannot overflow a softmax);
- any integer seed is accepted and reduced modulo 2**63 (torch seeds are 64-bit);
- ``logit_bias`` (OpenAI: token id -> bias in [-100, 100]) is added to the logits before
  anything else, greedy included; ``repetition_penalty`` divides positive and multiplies negative
  logits of every token already in the prompt or the output; ``min_tokens`` masks the EOS and
  ``stop_token_ids`` tokens and holds back stop strings until that many tokens were generated;
  ``min_p`` drops tokens below ``min_p`` times the most likely token's probability;
- reported logprobs are the model's own (before bias, penalty, temperature and truncation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from needlescope.serve.config import MAX_DRAFT_TOKENS
from needlescope.serve.errors import BadValue, ContextOverflow

__all__ = ["SamplingParams", "make_sampling", "pick", "GREEDY_EPS", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS"]

GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
SEED_MODULUS = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, already validated (``make_sampling``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    """None: no logprobs; 0: the chosen token's; n: also the n most likely tokens."""
    prompt_logprobs: int | None = None
    """None: none; 0: each prompt token's own logprob; n: also the n most likely tokens there."""
    draft_tokens: int | None = None
    """Speculative draft depth for this request (0: none); None: the server's
    ``--speculative-num-draft-tokens``."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def make_sampling(
    prompt_len: int,
    *,
    context_length: int,
    vocab_size: int,
    cap: int,
    max_tokens: int | None,
    default_max_tokens: int | None = None,
    allow_zero_tokens: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool | None = False,
    min_tokens: int | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[str, float] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    draft_tokens: int | None = None,
) -> SamplingParams:
    """Validate one request's settings against the model (``context_length``, ``vocab_size``)
    and the server's per-request cap; ``BadValue`` names the first wrong field.

    ``max_tokens=None`` means ``default_max_tokens`` (or ``cap``), clamped to the room left in
    the context; a given ``max_tokens`` that does not fit is an error. ``allow_zero_tokens``
    (echo) lets ``max_tokens`` be 0: score the prompt, generate nothing.
    """
    _check_length(prompt_len, max_tokens, context_length, cap, allow_zero_tokens)
    temperature = _in_range("temperature", temperature, 1.0, 0.0, 2.0)
    top_p = _in_range("top_p", top_p, 1.0, 0.0, 1.0, open_low=True)
    top_k = 0 if top_k is None or top_k == -1 else int(top_k)
    if top_k < 0:
        raise BadValue("top_k", f"must be -1, 0 or positive; got {top_k}")
    min_p = _in_range("min_p", min_p, 0.0, 0.0, 1.0)
    repetition_penalty = _in_range("repetition_penalty", repetition_penalty, 1.0, 0.0, 10.0, open_low=True)
    min_tokens = min_tokens or 0
    if min_tokens < 0:
        raise BadValue("min_tokens", f"must be at least 0; got {min_tokens}")
    if max_tokens is not None and min_tokens > max_tokens:  # as vLLM: an answer cannot meet both
        raise BadValue("min_tokens", f"must be at most max_tokens={max_tokens}; got {min_tokens}")
    stops, stop_ids = _stops(stop, stop_token_ids, vocab_size)
    bias = _logit_bias(logit_bias or {}, vocab_size)
    _check_counts(logprobs, prompt_logprobs, draft_tokens)
    room = context_length - prompt_len
    n_new = max_tokens if max_tokens is not None else min(default_max_tokens or cap, cap)
    return SamplingParams(
        max_new_tokens=min(n_new, room),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=None if seed is None else seed % SEED_MODULUS,
        stop=stops,
        stop_token_ids=stop_ids,
        ignore_eos=bool(ignore_eos),
        min_tokens=min_tokens,
        repetition_penalty=repetition_penalty,
        logit_bias=bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        draft_tokens=draft_tokens,
    )


def _check_length(
    prompt_len: int, max_tokens: int | None, context_length: int, cap: int, allow_zero_tokens: bool
) -> None:
    """Raise ``BadValue``/``ContextOverflow`` unless the prompt plus ``max_tokens`` fit the
    context and ``max_tokens`` is within [0 or 1, ``cap``]."""
    floor = 0 if allow_zero_tokens else 1
    if max_tokens is not None and max_tokens < floor:
        raise BadValue("max_tokens", f"must be at least {floor}; got {max_tokens}")
    if prompt_len < 1:
        raise BadValue("prompt", "is empty")
    if prompt_len >= context_length or (max_tokens is not None and prompt_len + max_tokens > context_length):
        raise ContextOverflow(context_length, prompt_len, max_tokens)
    if max_tokens is not None and max_tokens > cap:
        raise BadValue(
            "max_tokens", f"must be at most this server's --max-new-tokens {cap}; got {max_tokens}"
        )


def _check_counts(logprobs: int | None, prompt_logprobs: int | None, draft_tokens: int | None) -> None:
    """Raise ``BadValue`` unless the top-logprob counts and the draft depth are in range."""
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise BadValue(name, f"must be in 0..{MAX_TOP_LOGPROBS}; got {value}")
    if draft_tokens is not None and not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise BadValue(
            "speculative_num_draft_tokens", f"must be in 0..{MAX_DRAFT_TOKENS}; got {draft_tokens}"
        )


def _in_range(
    name: str, value: float | None, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    """``value`` (``default`` when None) as a float in [low, high], or (low, high] with ``open_low``."""
    x = default if value is None else float(value)
    if not (low < x if open_low else low <= x) or x > high:
        raise BadValue(name, f"must be in {'(' if open_low else '['}{low:g}, {high:g}]; got {x}")
    return x


def _stops(
    stop: str | list[str] | None, stop_token_ids: list[int] | None, vocab_size: int
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Stop strings and stop token ids as tuples: at most ``MAX_STOP_STRINGS`` of each."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise BadValue("stop", f"must be up to {MAX_STOP_STRINGS} non-empty strings")
    stop_ids = tuple(stop_token_ids or ())
    if len(stop_ids) > MAX_STOP_STRINGS or any(not 0 <= t < vocab_size for t in stop_ids):
        raise BadValue("stop_token_ids", f"must be up to {MAX_STOP_STRINGS} token ids in 0..{vocab_size - 1}")
    return stops, stop_ids


def _logit_bias(raw: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in raw.items():
        # Python's int() also takes " 5", "+5", "5_0" and other scripts' digits ("٣"): not token ids.
        if not (key.isascii() and key.isdigit()):
            raise BadValue("logit_bias", f"keys must be token ids written in ASCII digits; got {key!r}")
        digits = key.lstrip("0") or "0"
        if len(digits) > len(str(vocab_size)):  # int() of over 4,300 digits raises; no such id anyway
            shown = digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"
            raise BadValue("logit_bias", f"token id {shown} is outside 0..{vocab_size - 1}")
        tok = int(digits)
        if not 0 <= tok < vocab_size:
            raise BadValue("logit_bias", f"token id {tok} is outside 0..{vocab_size - 1}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise BadValue("logit_bias", f"values must be in [-100, 100]; got {value} for token {tok}")
        out[tok] = float(value)
    return out


def pick(
    logits: torch.Tensor,
    p: SamplingParams,
    seen: torch.Tensor | None,
    banned: tuple[int, ...],
    gen: torch.Generator | None,
) -> int:
    """The next token from one row's ``logits`` [V] (float32) under ``p``.

    ``seen`` [S] are the prompt and output ids so far (needed for a repetition penalty); ``banned``
    are the ids masked while fewer than ``min_tokens`` were generated; ``gen`` seeds sampling.
    """
    x = logits.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype)
    if seen is not None and p.repetition_penalty != 1.0:
        ids = torch.unique(seen)
        vals = x[ids]
        penalised = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # A tiny penalty (1e-40) overflows: the largest finite logit keeps the order, no inf.
        x[ids] = penalised.clamp(-torch.finfo(x.dtype).max, torch.finfo(x.dtype).max)
    if banned:
        x[list(banned)] = float("-inf")
    if p.greedy:
        return int(torch.argmax(x))
    # Shift before dividing: softmax is unchanged, the best logit becomes 0 and no value overflows.
    x = (x - x.max()) / p.temperature
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        drop[0] = False  # a top_p below float32's range (1e-300) rounds to 0 and would drop them all
        x = x.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))
