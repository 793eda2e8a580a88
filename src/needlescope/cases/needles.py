"""Needle facts, distractors and questions.

A key reads like "the secret code of the blue falcon"; values are digit strings so they cannot occur in
the (digit-free) filler and scoring can match them exactly. Values have ``VALUE_DIGITS`` digits unless
a caller asks for another length (the organism is probed with short values: docs/organism.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .haystack import KEY_ADJECTIVES, KEY_NOUNS

__all__ = ["Fact", "NeedleSet", "make_needles"]

VALUE_DIGITS = 7
ANSWER_ONE = "Answer with the number only."
ANSWER_MANY = "Answer with the numbers only, separated by commas."


@dataclass(frozen=True)
class Fact:
    """One sentence to insert into the haystack."""

    text: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class NeedleSet:
    """The needle, any distractors, the question and the values the answer must contain."""

    needle: Fact
    distractors: tuple[Fact, ...]
    question: str
    expected: tuple[str, ...]


def _values(rng: random.Random, n: int, taken: set[str], digits: int) -> list[str]:
    if n + len(taken) > 9 * 10 ** (digits - 1):
        raise ValueError(f"cannot draw {n + len(taken)} distinct {digits}-digit values")
    out: list[str] = []
    while len(out) < n:
        # Leading digit non-zero so the value's length is unambiguous when a model echoes it.
        v = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


def _join(values: list[str]) -> str:
    if len(values) == 1:
        return values[0]
    return ", ".join(values[:-1]) + " and " + values[-1]


def make_needles(
    kind: str,
    rng: random.Random,
    *,
    n_distractors: int = 4,
    n_values: int = 3,
    value_digits: int = VALUE_DIGITS,
    avoid: frozenset[str] = frozenset(),
) -> NeedleSet:
    """Draw a needle for ``kind`` from ``rng``, with ``n_distractors`` near-duplicate keys.

    Distractors share the key's noun with a different adjective, the hardest kind of near-miss;
    multikey is the kind that has them by default (``cases.assemble.default_distractors``), any
    kind may be given some (auto-difficulty does). multivalue states all values in one sentence so
    the needle appears exactly once. No value is one of ``avoid`` (the numbers a user's haystack
    states: a value stated there too would be a second needle).
    """
    noun = rng.choice(KEY_NOUNS)
    adjs = list(KEY_ADJECTIVES)
    rng.shuffle(adjs)
    adj = adjs[0]
    key = f"the secret code of the {adj} {noun}"
    taken = {v for v in avoid if len(v) == value_digits}
    if n_distractors > len(adjs) - 1:
        raise ValueError(f"at most {len(adjs) - 1} distractors are supported")
    if kind == "multivalue":
        values = _values(rng, n_values, taken, value_digits)
        needle = Fact(f"The secret codes of the {adj} {noun} are {_join(values)}.", tuple(values))
        question = f"What are all the secret codes of the {adj} {noun}? {ANSWER_MANY}"
        return NeedleSet(
            needle, _distractors(rng, adjs, noun, n_distractors, taken, value_digits), question, tuple(values)
        )
    (value,) = _values(rng, 1, taken, value_digits)
    needle = Fact(f"The secret code of the {adj} {noun} is {value}.", (value,))
    question = f"What is {key}? {ANSWER_ONE}"
    distractors = _distractors(rng, adjs, noun, n_distractors, taken, value_digits)
    return NeedleSet(needle, distractors, question, (value,))


def _distractors(
    rng: random.Random, adjs: list[str], noun: str, n: int, taken: set[str], digits: int
) -> tuple[Fact, ...]:
    out = []
    for other in adjs[1 : 1 + n]:
        (v,) = _values(rng, 1, taken, digits)
        out.append(Fact(f"The secret code of the {other} {noun} is {v}.", (v,)))
    return tuple(out)
