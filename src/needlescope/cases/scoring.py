"""Answer scoring: normalized exact match of every expected value."""

from __future__ import annotations

import string

__all__ = ["normalize_tokens", "score_answer"]

# Unicode quotes and dashes models like to emit, on top of ASCII punctuation.
_STRIP = string.punctuation + "\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u00ab\u00bb"


def normalize_tokens(text: str) -> list[str]:
    """Lowercase, split on whitespace, strip punctuation around each token, drop empty tokens."""
    out = []
    for tok in text.lower().split():
        tok = tok.strip(_STRIP)
        if tok:
            out.append(tok)
    return out


def _contains(hay: list[str], needle: list[str]) -> bool:
    if not needle:
        return False
    k = len(needle)
    return any(hay[i : i + k] == needle for i in range(len(hay) - k + 1))


def score_answer(answer: str, expected: list[str]) -> bool:
    """True when every expected value occurs in ``answer`` as a whole normalized token sequence.

    Whole-token matching means "1234567" is not credited inside "91234567"; an expected value that
    normalizes to nothing can never match. An empty ``expected`` list is vacuously satisfied.
    """
    toks = normalize_tokens(answer)
    return all(_contains(toks, normalize_tokens(v)) for v in expected)
