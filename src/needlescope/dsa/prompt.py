"""Prompts and needles for the white-box commands: token ids, the needle's token span, its entries.

A prompt file is either plain text (sent as one user turn) or a JSON list of chat messages
(``[{"role": "user", "content": "..."}]``); both are rendered with the checkpoint's chat
template and the generation prompt, exactly as ``needlescope serve`` renders a request.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from needlescope.errors import BadInput

__all__ = [
    "ROLES",
    "Prompt",
    "read_prompt_file",
    "render_prompt",
    "needle_token_span",
    "resolve_needle_span",
    "covering_entries",
]

ROLES = ("system", "user", "assistant")
"""Message roles a prompt file may use (the chat templates of DeepSeek-V4 checkpoints render these)."""


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: its text, token ids and each token's character span in the text."""

    text: str
    input_ids: list[int]
    offsets: list[tuple[int, int]]


def read_prompt_file(path: str | Path) -> list[dict]:
    """Chat messages from a prompt file (JSON messages list, or plain text as one user turn)."""
    path = Path(path)
    if path.is_dir():
        raise BadInput(f"prompt file {str(path)!r} is a directory; pass a text or JSON messages file")
    if not path.is_file():
        raise BadInput(f"prompt file {str(path)!r} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(
            f"prompt file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "pass plain text or a JSON messages list"
        ) from exc
    except OSError as exc:
        raise BadInput(f"prompt file {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    if not raw.strip():
        raise BadInput(f"prompt file {str(path)!r} is empty")
    if raw.lstrip().startswith("["):
        try:
            messages = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadInput(f"prompt file {str(path)!r} starts with '[' but is not valid JSON: {exc}") from exc
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise BadInput(
                f"prompt file {str(path)!r} must be a JSON list of {{'role': str, 'content': str}} messages"
            )
        unknown = sorted({m["role"] for m in messages} - set(ROLES))
        if unknown:
            raise BadInput(
                f"prompt file {str(path)!r} uses unknown role(s) {', '.join(map(repr, unknown))}; "
                f"allowed roles: {', '.join(ROLES)}"
            )
        return messages
    return [{"role": "user", "content": raw}]


RENDERED_KEPT = 64
"""Rendered prompts kept (``render_prompt``): an investigation renders each probe case for every
configuration, path and step it measures; at 4K tokens one rendering costs milliseconds."""

_RENDERED: OrderedDict[tuple, tuple[object, Prompt]] = OrderedDict()


def render_prompt(tokenizer, messages: list[dict], *, warn_long: bool = True) -> Prompt:
    """Render ``messages`` with the chat template (generation prompt added) and tokenize with offsets.

    ``warn_long=False``: the caller checks the length against the model's context itself and
    says so in one line, so transformers' "longer than the maximum" warning is not printed.
    The last ``RENDERED_KEPT`` renderings are kept (per tokenizer object and chat template): the
    same messages come back as a copy of the same prompt without tokenizing again."""
    key = (
        id(tokenizer),
        getattr(tokenizer, "chat_template", None),
        warn_long,
        json.dumps(messages, sort_keys=True),
    )
    hit = _RENDERED.get(key)
    if hit is not None and hit[0] is tokenizer:
        _RENDERED.move_to_end(key)
        kept = hit[1]
        return Prompt(text=kept.text, input_ids=list(kept.input_ids), offsets=list(kept.offsets))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=warn_long)
    prompt = Prompt(
        text=text, input_ids=list(enc["input_ids"]), offsets=[tuple(o) for o in enc["offset_mapping"]]
    )
    _RENDERED[key] = (
        tokenizer,
        Prompt(text=text, input_ids=list(prompt.input_ids), offsets=list(prompt.offsets)),
    )
    while len(_RENDERED) > RENDERED_KEPT:
        _RENDERED.popitem(last=False)
    return prompt


def needle_token_span(prompt: Prompt, needle: str) -> tuple[int, int]:
    """[start, end) token indices of the tokens overlapping the first occurrence of ``needle``.

    BadInput when the needle text is not in the prompt, or occurs more than once (the span
    would be ambiguous: pass a longer needle).
    """
    if not needle:
        raise BadInput("the needle text is empty; pass the fact's text as it appears in the prompt")
    at = prompt.text.find(needle)
    if at < 0:
        raise BadInput(
            f"needle {needle[:60]!r} was not found in the rendered prompt; pass text copied from it"
        )
    if prompt.text.find(needle, at + 1) >= 0:
        raise BadInput(
            f"needle {needle[:60]!r} occurs more than once in the prompt; pass a longer, unique span"
        )
    end = at + len(needle)
    toks = [i for i, (s, e) in enumerate(prompt.offsets) if s < end and e > at]
    if not toks:
        raise BadInput(f"needle {needle[:60]!r} covers no tokens of the prompt")
    return toks[0], toks[-1] + 1


def resolve_needle_span(
    prompt: Prompt, needle: str | None = None, needle_span: tuple[int, int] | None = None
) -> tuple[int, int]:
    """[start, end) token span of the needle, from an explicit span (checked against the prompt)
    or from its text (``needle_token_span``); BadInput when neither is given or the span is outside."""
    n = len(prompt.input_ids)
    if needle_span is not None:
        start, end = int(needle_span[0]), int(needle_span[1])
        if not 0 <= start < end <= n:
            raise BadInput(
                f"needle span {start}:{end} is not a non-empty token range inside the {n}-token prompt"
            )
        return start, end
    if needle is not None:
        return needle_token_span(prompt, needle)
    raise BadInput("give the needle as text (--needle) or as a token span (--needle-span START:END)")


def covering_entries(span: tuple[int, int], ratio: int = 4, *, overlap: bool = True) -> list[int]:
    """Compressed entries that pool any token of ``span`` ([start, end) token indices).

    Entry i's own block is tokens [ratio*i, ratio*i + ratio). With ``overlap`` (CSA), entry
    i also pools block i-1 through its first half of channels, so the entry after the
    needle's last block carries needle tokens too and is included.
    """
    start, end = span
    if end <= start:
        return []
    last = (end - 1) // ratio + (1 if overlap else 0)
    return list(range(start // ratio, last + 1))
