"""Turn a CaseSpec into concrete, exactly-sized chat requests."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import cached_property

from ..errors import BadInput
from ..progress import Progress, no_progress
from .haystack import FillerStream, render_words, sentence_boundaries
from .needles import VALUE_DIGITS, NeedleSet, make_needles
from .scoring import answer_tokens

__all__ = [
    "KINDS",
    "MAX_DISTRACTORS",
    "default_distractors",
    "CaseSpec",
    "Case",
    "build_cases",
    "order_for_prefix_cache",
]

KINDS = ("single", "multikey", "multivalue", "multiturn")
# Distinct key adjectives less the needle's own (haystack.KEY_ADJECTIVES).
MAX_DISTRACTORS = 19
CountTokens = Callable[[list[dict]], int]

# How far the local search may wander (in filler words) around a candidate filler size. Tokenizers
# merge across word boundaries, so a target can sit between two adjacent word counts; past this many
# attempts we accept the closest count and let counted_length say so.
_LOCAL_SEARCH = 8
# A filler size: (words, join). ``join`` folds a truncated last sentence into the one before it
# (FillerStream.words), the one-token knob that reaches lengths a sentence-final period skips over.
Size = tuple[int, bool]
_INTRO = "Below is a long text. Read it carefully; a question about it follows at the end.\n\n"


@dataclass(frozen=True)
class CaseSpec:
    """What to generate: one case per (length, depth, trial)."""

    kind: str
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    seed: int
    haystack_text: str | None = None
    n_distractors: int | None = None
    """Near-duplicate keys in the prompt; None: the kind's default (``default_distractors``)."""
    n_values: int = 3
    max_answer_tokens: int = 32
    value_digits: int = VALUE_DIGITS

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadInput(f"unknown case kind {self.kind!r}; allowed values: {', '.join(KINDS)}")
        if not self.lengths:
            raise BadInput("no lengths given; give at least one target length in tokens")
        if any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in self.lengths):
            raise BadInput(f"lengths must be positive integers, got {list(self.lengths)}")
        if len(set(self.lengths)) != len(self.lengths):
            raise BadInput(f"lengths contain duplicates: {list(self.lengths)}")
        if not self.depths:
            raise BadInput("no depths given; give at least one depth percent in 0..100")
        if any(not (0.0 <= float(d) <= 100.0) for d in self.depths):
            raise BadInput(f"depths must be percentages in 0..100, got {list(self.depths)}")
        if len(set(self.depths)) != len(self.depths):
            raise BadInput(f"depths contain duplicates: {list(self.depths)}")
        if self.trials < 1:
            raise BadInput(f"trials must be >= 1, got {self.trials}")
        if not 0 <= self.distractors <= MAX_DISTRACTORS:
            raise BadInput(f"distractors must be in 0..{MAX_DISTRACTORS}, got {self.n_distractors}")
        if self.n_values < 1:
            raise BadInput(f"n_values must be >= 1, got {self.n_values}")
        if not 1 <= self.value_digits <= 12:
            raise BadInput(f"value_digits must be in 1..12, got {self.value_digits}")
        needed = self.distractors + max(1, self.n_values if self.kind == "multivalue" else 1)
        free = 9 * 10 ** (self.value_digits - 1) - len(self.haystack_values)
        if needed > free:
            stated = " not stated in the haystack file" if self.haystack_values else ""
            raise BadInput(
                f"{self.value_digits}-digit values{stated} cannot give {needed} distinct values; use more digits"
            )
        if self.max_answer_tokens < 1:
            raise BadInput(f"max_answer_tokens must be >= 1, got {self.max_answer_tokens}")
        if self.haystack_text is not None and not self.haystack_text.split():
            raise BadInput("the haystack file is empty; give a file with some text or omit it")

    @cached_property
    def haystack_values(self) -> frozenset[str]:
        """The ``value_digits``-digit numbers the user's haystack states (no value may be one)."""
        if self.haystack_text is None:
            return frozenset()
        return frozenset(
            t
            for t in answer_tokens(self.haystack_text)
            if t.isdigit() and len(t) == self.value_digits and t[0] != "0"
        )

    @property
    def distractors(self) -> int:
        return default_distractors(self.kind) if self.n_distractors is None else self.n_distractors


def default_distractors(kind: str) -> int:
    """Near-duplicate keys a kind has unless told otherwise: multikey 4, the others none."""
    return 4 if kind == "multikey" else 0


@dataclass(frozen=True)
class Case:
    """One request to send and how to judge its answer."""

    case_id: str
    kind: str
    length: int
    depth: float
    trial: int
    messages: list[dict]
    expected: list[str]
    question: str
    needle: str
    group: str
    counted_length: int

    def to_dict(self) -> dict:
        """A JSON-able dict (copies, so callers cannot mutate the case)."""
        return asdict(self)


class _Group:
    """Everything shared by the cases of one (kind, length, trial): filler, needles, placements."""

    def __init__(self, spec: CaseSpec, length: int, trial: int) -> None:
        base = f"needlescope|{spec.seed}|{spec.kind}|{length}|{trial}"
        # Separate string-seeded generators (stable across Python runs) so the filler text does not
        # depend on how many draws the needles took, and nothing touches the module-level random.
        if spec.haystack_text is not None:
            self.stream = FillerStream(text=spec.haystack_text)
        else:
            self.stream = FillerStream(rng=random.Random(base + "|filler"))
        self.needles: NeedleSet = make_needles(
            spec.kind,
            random.Random(base + "|needle"),
            n_distractors=spec.distractors,
            n_values=spec.n_values,
            value_digits=spec.value_digits,
            avoid=spec.haystack_values,
        )
        pos_rng = random.Random(base + "|positions")
        self.distractor_fracs = [pos_rng.random() for _ in self.needles.distractors]
        self.kind = spec.kind
        # Multiturn: a few hundred tokens per turn pair reads like a real conversation.
        self.pairs = max(1, min(32, length // 300))
        # Multiturn: turn starts, frozen once the size is roughly known so that near the fit only
        # the last turn grows (proportional cuts move every turn's end, and counts jump about).
        self.cuts: list[int] | None = None
        self.fitted: Size | None = None

    def messages(self, n: int, depth: float, join: bool = False) -> list[dict]:
        words = self.stream.words(n, join)
        if self.kind == "multiturn":
            return self._multiturn(words, depth)
        inserts = [(f, d.text) for f, d in zip(self.distractor_fracs, self.needles.distractors, strict=True)]
        body = _insert(words, inserts, depth / 100.0, self.needles.needle.text)
        return [{"role": "user", "content": f"{_INTRO}{body}\n\n{self.needles.question}"}]

    def _turn(self, frac: float) -> tuple[int, float]:
        """(user turn, fraction inside it) of a position ``frac`` (0..1) over the user turns
        (where distractors go)."""
        scaled = frac * self.pairs
        turn = min(self.pairs - 1, math.floor(scaled))
        return turn, scaled - turn

    @staticmethod
    def _at_depth(frac: float, cuts: list[int]) -> tuple[list[int], int, float]:
        """(turn starts, the user turn holding the needle, fraction inside it) for depth ``frac`` (0..1).

        Depth is a position in the whole prompt, as in NIAH and RULER: every turn counts, the
        assistant's too (depth over the user turns alone put depth 100 at 46% of a 512-token
        prompt). The needle stays in a user turn: where its position falls in an assistant turn,
        the user turn before it runs on to that position (the assistant's turn keeps its last word).
        ``cuts``: each turn's first word index (even turns the user's), then the word count.
        """
        cuts = list(cuts)
        word = frac * cuts[-1]
        turn = next((i for i in range(len(cuts) - 1) if word < cuts[i + 1]), len(cuts) - 2)
        if turn % 2:
            cuts[turn] = max(cuts[turn], min(math.ceil(word), cuts[turn + 1] - 1))
            turn -= 1
        size = cuts[turn + 1] - cuts[turn]
        return cuts, turn // 2, (min(max(word - cuts[turn], 0.0), size) / size) if size else 0.0

    def _multiturn(self, words: list[str], depth: float) -> list[dict]:
        slots = 2 * self.pairs
        n = len(words)
        if self.cuts is not None and n > self.cuts[-1]:
            cuts = [*self.cuts, n]
        else:
            cuts = [i * n // slots for i in range(slots + 1)]
        cuts, turn, frac = self._at_depth(depth / 100.0, cuts)
        chunks = [list(words[cuts[i] : cuts[i + 1]]) for i in range(slots)]
        for c in chunks:
            if c and not c[-1].endswith((".", "!", "?")):
                c[-1] += "."
        # Distractors go into user turns by their own fractions of the user turns.
        inserts: dict[int, list[tuple[float, str]]] = {}
        for f, d in zip(self.distractor_fracs, self.needles.distractors, strict=True):
            t, within = self._turn(f)
            inserts.setdefault(t, []).append((within, d.text))
        msgs: list[dict] = []
        for i, chunk in enumerate(chunks):
            role = "user" if i % 2 == 0 else "assistant"
            if i == 2 * turn:
                text = _insert(chunk, inserts.get(turn, []), frac, self.needles.needle.text)
            elif i % 2 == 0 and i // 2 in inserts:
                text = _insert(chunk, inserts[i // 2], None, None)
            else:
                text = render_words(chunk)
            msgs.append({"role": role, "content": text})
        msgs.append(
            {
                "role": "user",
                "content": f"Think back over our conversation. {self.needles.question}",
            }
        )
        return msgs


def _insert(
    words: list[str], inserts: list[tuple[float, str]], needle_frac: float | None, needle: str | None
) -> str:
    """Render ``words`` with sentences inserted at sentence boundaries (the needle, if given, last).

    Fractions map onto the boundary list (0 = before the first sentence, 1 = after the last).
    Distractors go before the needle at a shared boundary so needle position stays monotone in depth.
    """
    bounds = sentence_boundaries(words) or [0]
    at: dict[int, list[str]] = {}
    for frac, text in inserts:
        at.setdefault(bounds[round(frac * (len(bounds) - 1))], []).append(text)
    if needle is not None and needle_frac is not None:
        at.setdefault(bounds[round(needle_frac * (len(bounds) - 1))], []).append(needle)
    out: list[str] = []
    for i in range(len(words) + 1):
        out.extend(at.get(i, ()))
        if i < len(words):
            out.append(words[i])
    return render_words(out)


def _around(n: int, first: Size | None = None) -> list[Size]:
    """Sizes near ``n`` words, nearest first, each with and without the join knob."""
    sizes = [first] if first is not None else []
    for k in range(_LOCAL_SEARCH):
        for m in (n - k, n + k) if k else (n,):
            sizes += [(m, False), (m, True)]
    return sizes


def _closest(count: Callable[[Size], int], target: int, candidates: Iterable[Size]) -> tuple[Size, int]:
    """The first candidate that counts exactly ``target``, else the closest one (first on ties)."""
    best: tuple[int, Size, int] | None = None  # (distance, size, counted)
    for size in candidates:
        if size[0] < 0:
            continue
        c = count(size)
        if best is None or abs(c - target) < best[0]:
            best = (abs(c - target), size, c)
        if c == target:
            break
    assert best is not None
    return best[1], best[2]


_MAX_WORDS_PER_TOKEN = 8
"""Filler words a token may take at most: a tokenizer counts every English word as a token or
more, so a count that needs eight words a token is not counting the text (the search doubled
the filler without end)."""


def _fit(count: Callable[[Size], int], target: int, start: int = 0) -> tuple[Size, int]:
    """A filler size from ``start`` words up whose request counts ``target`` tokens (or the closest).

    Bisection on the word count (counts grow with it) brackets the target; the local search then
    tries both knob settings around the bracket, since a sentence-final period can step over it.
    """

    def words(n: int) -> int:
        return count((n, False))

    if words(start) >= target:
        return _closest(count, target, _around(start))
    lo, hi = start, start + max(1, target - words(start))
    while words(hi) < target:  # invariant: words(lo) < target
        if hi - start > _MAX_WORDS_PER_TOKEN * target + 1024:
            raise BadInput(
                f"{hi - start} filler words count {words(hi)} tokens, short of {target}: the token "
                "count does not grow with the text (a chat template that leaves out the messages, "
                "or a tokenize endpoint that does not count them); pass the checkpoint's tokenizer"
            )
        lo, hi = hi, start + 2 * (hi - start)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if words(mid) < target:
            lo = mid
        else:
            hi = mid
    return _closest(count, target, _around(hi))


def _counter(g: _Group, depth: float, count_tokens: CountTokens) -> Callable[[Size], int]:
    """Memoised token count of ``g``'s request at ``depth`` for a filler size."""
    memo: dict[Size, int] = {}

    def count(size: Size) -> int:
        if size not in memo:
            memo[size] = count_tokens(g.messages(size[0], depth, size[1]))
        return memo[size]

    return count


def build_cases(spec: CaseSpec, count_tokens: CountTokens, progress: Progress = no_progress) -> list[Case]:
    """Build every case of ``spec``, sized so ``count_tokens(messages)`` equals the target length.

    Ordered by length, then depth, then trial. Deterministic for a given spec. ``progress`` hears
    of each case built (``building cases``): counting through a server takes a while.
    """
    groups: dict[tuple[int, int], _Group] = {}

    def group(length: int, trial: int) -> _Group:
        key = (length, trial)
        if key not in groups:
            groups[key] = _Group(spec, length, trial)
        return groups[key]

    # Fail before any expensive fitting if a length cannot hold the needle and question.
    for length in spec.lengths:
        g = group(length, 0)
        floor = count_tokens(g.messages(0, 0.0))
        while floor > length and g.pairs > 1:
            g.pairs = max(1, g.pairs // 2)
            floor = count_tokens(g.messages(0, 0.0))
        if floor > length:
            raise BadInput(
                f"length {length} is shorter than the needle and question ({floor} tokens); "
                f"use lengths >= {floor}"
            )

    cases: list[Case] = []
    total = len(spec.lengths) * len(spec.depths) * spec.trials
    progress("building cases", 0, total, "")
    for length in spec.lengths:
        for depth in spec.depths:
            for trial in range(spec.trials):
                g = group(length, trial)
                if trial != 0:
                    g.pairs = groups[(length, 0)].pairs
                if g.fitted is None:
                    size, counted = _fit(_counter(g, depth, count_tokens), length)
                    if g.kind == "multiturn":
                        g.cuts = [i * size[0] // (2 * g.pairs) for i in range(2 * g.pairs)]
                        size, counted = _fit(_counter(g, depth, count_tokens), length, g.cuts[-1] + 1)
                    g.fitted = size
                else:
                    # The needle is the same size at every depth, so the fitted size almost always
                    # carries over; only tokenizer seams near the insertion point need a nudge.
                    size, counted = _closest(
                        _counter(g, depth, count_tokens), length, _around(g.fitted[0], g.fitted)
                    )
                n, join = size
                ns = g.needles
                cases.append(
                    Case(
                        case_id=f"{spec.kind}-L{length}-D{depth:g}-T{trial}",
                        kind=spec.kind,
                        length=length,
                        depth=float(depth),
                        trial=trial,
                        messages=g.messages(n, depth, join),
                        expected=list(ns.expected),
                        question=ns.question,
                        needle=ns.needle.text,
                        group=f"{spec.kind}-L{length}-T{trial}",
                        counted_length=counted,
                    )
                )
                progress("building cases", len(cases), total, "")
    return cases


def order_for_prefix_cache(cases: Iterable[Case]) -> list[Case]:
    """Group-contiguous order (groups by first appearance), deepest needle first within a group.

    Within a group the filler is identical, so consecutive requests share the prefix up to the
    earlier needle; leading with the deepest needle warms the longest prefix first.
    """
    cases = list(cases)
    first: dict[str, int] = {}
    for i, c in enumerate(cases):
        first.setdefault(c.group, i)
    return sorted(cases, key=lambda c: (first[c.group], -c.depth))
