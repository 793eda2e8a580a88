"""Answer scoring: normalized exact match of every expected value, and of no rival value.

An answer is read as words and numbers: NFKC-normalized and lower-cased, every digit of any script
read as its ASCII digit (a model may answer "４８１７２６３" or "٤٨١٧٢٦٣"), then split into runs of
letters and runs of digits, everything else a separator. So "code:4817263", "<b>4817263</b>" and
"4817263。" give the value, "123,456,789" gives three values (multivalue asks for "the numbers
only, separated by commas"), while "91234567" and "123 4567" never give "1234567". A number
written with thousands separators ("4,817,263") gives its value too. A reasoning block
(``<think>...</think>``) before the answer is not the answer: only what follows it is scored.

``rivals`` are the other values the prompt states (its distractors, ``prompt_rivals``): an answer
that names one beside the right value ("4817263 or 5551234") is a hedge, not a recall, and is a
miss (the failure taxonomy classes it ``distractor``).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "answer_tokens",
    "names_any",
    "normalize_tokens",
    "prompt_rivals",
    "score_answer",
    "strip_reasoning",
]

# Unicode quotes and dashes models like to emit, on top of ASCII punctuation.
_STRIP = string.punctuation + "\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u00ab\u00bb"
_TOKEN = re.compile(r"\d+|[^\W\d_]+")
# A number grouped by thousands: 1-3 digits, then groups of exactly three after commas.
_GROUPED = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d]|,\d)")
_THINK_END = "</think>"


def normalize_tokens(text: str) -> list[str]:
    """Lowercase, split on whitespace, strip punctuation around each token, drop empty tokens."""
    out = []
    for tok in text.lower().split():
        tok = tok.strip(_STRIP)
        if tok:
            out.append(tok)
    return out


def _ascii_digits(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return "".join(str(unicodedata.decimal(ch)) if ch.isdecimal() else ch for ch in text)


def answer_tokens(text: str) -> list[str]:
    """The words and numbers of ``text`` as scoring reads them (module docstring)."""
    return _TOKEN.findall(_ascii_digits(text))


def strip_reasoning(answer: str) -> str:
    """The answer after a ``<think>`` block; "" when the block never closed (no answer came)."""
    if _THINK_END in answer:
        return answer.rsplit(_THINK_END, 1)[1]
    return "" if answer.lstrip().startswith("<think>") else answer


def prompt_rivals(messages: Sequence[dict], expected: Iterable[str]) -> list[str]:
    """The numbers ``messages`` state, other than the expected values, with as many digits as an
    expected value: the values an answer must not name beside the right one (the distractors;
    the generated filler has no digits). Numbers of other lengths (a year, a section number in a
    user's haystack file) are not rivals: an answer that cites one beside the value still recalls it."""
    wanted = {tuple(answer_tokens(v)) for v in expected}
    widths = {len(t[0]) for t in wanted if len(t) == 1 and t[0].isdigit()}
    found: dict[str, None] = {}
    for m in messages:
        for tok in answer_tokens(str(m.get("content") or "")):
            if tok.isdigit() and len(tok) in widths and (tok,) not in wanted:
                found[tok] = None
    return list(found)


def _contains(hay: list[str], needle: list[str]) -> bool:
    if not needle:
        return False
    k = len(needle)
    return any(hay[i : i + k] == needle for i in range(len(hay) - k + 1))


def score_answer(answer: str, expected: list[str], rivals: Iterable[str] = ()) -> bool:
    """True when every expected value occurs in ``answer`` as a whole normalized token sequence
    and no ``rivals`` value does.

    Whole-token matching means "1234567" is not credited inside "91234567"; an expected value that
    normalizes to nothing can never match. An empty ``expected`` list is vacuously satisfied.
    """
    said = _reader(answer)
    return all(said(v) for v in expected) and not any(said(r) for r in rivals)


def names_any(answer: str, values: Iterable[str]) -> bool:
    """True when ``answer`` names one of ``values`` (read as ``score_answer`` reads it)."""
    said = _reader(answer)
    return any(said(v) for v in values)


def _reader(answer: str) -> Callable[[str], bool]:
    """Whether the answer (after any reasoning block) names a value, as a whole token sequence
    or as a thousands-grouped number."""
    answer = strip_reasoning(answer)
    toks = answer_tokens(answer)
    grouped = {m.group().replace(",", "") for m in _GROUPED.finditer(_ascii_digits(answer))}

    def said(value: str) -> bool:
        want = answer_tokens(value)
        return _contains(toks, want) or (len(want) == 1 and want[0] in grouped)

    return said
