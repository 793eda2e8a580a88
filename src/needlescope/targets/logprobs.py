"""Teacher-forced scoring of a gold answer through whatever logprob interface the server offers.

The prompt is the chat exactly as the server renders it (its ``/tokenize`` with the messages and
the generation prompt), followed by the gold answer's tokens (its ``/tokenize`` of the answer
text, no special tokens); the server scores every gold token at its position. Three interfaces,
tried in this order by ``detect_method`` (the first that scores a tiny prompt wins, and the run
records which):

- ``prompt_logprobs``: vLLM's ``/v1/completions`` with ``prompt_logprobs=K``: each prompt
  token's logprob and exact rank, with the top K there (keyed by token id);
- ``echo``: OpenAI's legacy ``/v1/completions`` with ``echo=true, logprobs=K``: each prompt
  token's logprob and the top K there (keyed by token text; the rank is derived);
- ``sglang_generate``: SGLang's ``/generate`` with ``return_logprob``, ``logprob_start_len`` and
  ``top_logprobs_num=K``.

A server with none of them (or without ``/tokenize``) gives a method of None and a note saying why.
The answer is scored as the whole reply at the answer position (what a model that answers
"with the number only" emits); a multi-value answer is its values joined by ", ".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from needlescope.analysis.margins import TokenScore, answer_score, token_score
from needlescope.errors import ProbeError, ProtocolViolation
from needlescope.targets.client import ChatTarget

__all__ = ["METHODS", "GradedMethod", "detect_method", "gold_text", "score_gold"]

METHODS = ("prompt_logprobs", "echo", "sglang_generate")
# Token-id endpoints, vLLM's first (needlescope serve and SGLang answer it too).
_TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")
_PING = [{"role": "user", "content": "What is 1? Answer with the number only."}]


@dataclass(frozen=True)
class GradedMethod:
    """How gold answers are scored on this server (``method`` None: they cannot be)."""

    method: str | None
    tokenize: str | None
    note: str
    top: int

    def to_dict(self) -> dict:
        return {"method": self.method, "tokenize": self.tokenize, "note": self.note, "top_logprobs": self.top}


def gold_text(expected: list[str]) -> str:
    """The gold answer as the model is asked to give it."""
    return ", ".join(expected)


async def _ids(target: ChatTarget, path: str, body: dict) -> list[int]:
    reply = await target.post_json(path, {"model": target.model, **body}, at_root=True)
    ids = reply.get("tokens", reply.get("input_ids"))
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ProtocolViolation(f"{path} answered no token ids: {str(reply)[:200]}")
    return ids


async def _prompt_and_gold(
    target: ChatTarget, tokenize: str, messages: list[dict], gold: str, template_kwargs: dict | None
) -> tuple[list[int], list[int]]:
    chat: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
    if template_kwargs:
        chat["chat_template_kwargs"] = template_kwargs
    prompt = await _ids(target, tokenize, chat)
    answer = await _ids(target, tokenize, {"prompt": gold, "add_special_tokens": False})
    if not answer:
        raise ProtocolViolation(f"{tokenize} gave no tokens for the gold answer {gold!r}")
    return prompt, answer


def _at(seq: Any, i: int, what: str) -> Any:
    if not isinstance(seq, list) or len(seq) <= i:
        raise ProtocolViolation(f"the server's {what} has no entry for prompt position {i}")
    return seq[i]


def _from_prompt_logprobs(body: dict, prompt: list[int], gold: list[int]) -> list[TokenScore]:
    entries = _at(body.get("choices"), 0, "choices").get("prompt_logprobs")
    out = []
    for j, tid in enumerate(gold):
        entry = _at(entries, len(prompt) + j, "prompt_logprobs")
        if not isinstance(entry, dict) or str(tid) not in entry:
            raise ProtocolViolation(
                f"prompt_logprobs at position {len(prompt) + j} lacks the prompt token {tid}"
            )
        alts = {int(k): float(v["logprob"]) for k, v in entry.items()}
        out.append(token_score(tid, alts[tid], alts, rank=entry[str(tid)].get("rank")))
    return out


def _from_echo(body: dict, prompt: list[int], gold: list[int]) -> list[TokenScore]:
    lp = _at(body.get("choices"), 0, "choices").get("logprobs") or {}
    out = []
    for j in range(len(gold)):
        i = len(prompt) + j
        text = _at(lp.get("tokens"), i, "echo tokens")
        value = _at(lp.get("token_logprobs"), i, "echo token_logprobs")
        alts = _at(lp.get("top_logprobs"), i, "echo top_logprobs") or {}
        if not isinstance(value, (int, float)):
            raise ProtocolViolation(f"echo gave no logprob for prompt position {i}")
        out.append(token_score(text, float(value), {k: float(v) for k, v in alts.items()}))
    return out


def _from_sglang(body: dict, prompt: list[int], gold: list[int]) -> list[TokenScore]:
    meta = body.get("meta_info") or {}
    chosen = meta.get("input_token_logprobs")
    tops = meta.get("input_top_logprobs")
    if not isinstance(chosen, list) or not isinstance(tops, list) or len(chosen) < len(gold):
        raise ProtocolViolation("/generate returned no input_token_logprobs for the gold tokens")
    out = []
    # The lists end at the last prompt token; the gold tokens are their last len(gold) entries.
    for (value, tid, *_), top in zip(chosen[-len(gold) :], tops[-len(gold) :], strict=True):
        alts = {int(t[1]): float(t[0]) for t in top or []}
        out.append(token_score(int(tid), float(value), alts))
    return out


def _request(method: str, prompt: list[int], gold: list[int], model: str, top: int) -> tuple[str, dict, bool]:
    """(path, body, at_root) that scores ``prompt + gold`` with ``method``."""
    ids = prompt + gold
    if method == "prompt_logprobs":
        return "/completions", {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": top}, False
    if method == "echo":
        body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": top}
        return "/completions", body, False
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": len(prompt),
        "top_logprobs_num": top,
    }
    return "/generate", body, True


_PARSERS = {"prompt_logprobs": _from_prompt_logprobs, "echo": _from_echo, "sglang_generate": _from_sglang}


async def score_gold(
    target: ChatTarget,
    method: GradedMethod,
    messages: list[dict],
    expected: list[str],
    *,
    template_kwargs: dict | None = None,
) -> dict:
    """The teacher-forced ``answer_score`` of the gold answer to ``messages`` (plus ``method``)."""
    if method.method is None or method.tokenize is None:
        raise ValueError("score_gold needs a detected method")
    prompt, gold = await _prompt_and_gold(
        target, method.tokenize, messages, gold_text(expected), template_kwargs
    )
    path, body, at_root = _request(method.method, prompt, gold, target.model, method.top)
    reply = await target.post_json(path, body, at_root=at_root)
    try:
        tokens = _PARSERS[method.method](reply, prompt, gold)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ProtocolViolation(f"{method.method}: malformed logprobs ({type(e).__name__}: {e})") from None
    _check_logprobs(method.method, tokens)
    return {"method": method.method, **answer_score(tokens)}


# Rounding slack above 0 for a log-probability a server printed from a float32 softmax.
_LOGPROB_SLACK = 1e-3


def _check_logprobs(method: str, tokens: list[TokenScore]) -> None:
    """ProtocolViolation unless every logprob read is a finite number <= 0: a NaN, an infinity
    or a probability above 1 is a broken scorer, and once averaged it made every margin of its
    cell NaN and summary.json invalid JSON (NaN, -Infinity)."""
    for i, t in enumerate(tokens):
        for value in (t.logprob, t.best_other):
            if value is not None and not (math.isfinite(value) and value <= _LOGPROB_SLACK):
                raise ProtocolViolation(
                    f"{method}: gold token {i} has a logprob of {value} (a logprob is a finite number <= 0)"
                )


async def detect_method(target: ChatTarget, top: int, template_kwargs: dict | None = None) -> GradedMethod:
    """The first interface that scores a tiny prompt on ``target``, or None with the reasons."""
    tokenize, reasons = None, []
    for path in _TOKENIZE_PATHS:
        try:
            await _ids(target, path, {"prompt": "1", "add_special_tokens": False})
        except ProbeError as e:
            reasons.append(f"{path}: {e}")
            continue
        tokenize = path
        break
    if tokenize is None:
        return GradedMethod(
            None, None, "no graded signal: the server gives no token ids (" + "; ".join(reasons) + ")", top
        )
    for name in METHODS:
        probe = GradedMethod(name, tokenize, "", top)
        try:
            scored = await score_gold(target, probe, _PING, ["1"], template_kwargs=template_kwargs)
        except ProbeError as e:
            reasons.append(f"{name}: {e}")
            continue
        if scored["min_margin"] is None:
            reasons.append(f"{name}: no alternatives returned with the gold token")
            continue
        return GradedMethod(name, tokenize, f"gold answers scored with {name} (top {top} alternatives)", top)
    return GradedMethod(
        None,
        tokenize,
        "no graded signal: the server offers no prompt logprobs (" + "; ".join(reasons) + ")",
        top,
    )
