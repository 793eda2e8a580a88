"""How an answer failed: a class for every miss, with the evidence that put it there.

Classes, checked in this order (the first that applies wins):

- ``reasoning_exhausted``: no answer, ``finish_reason=length`` and reasoning text present (thinking
  consumed ``max_tokens``);
- ``empty_or_length``: no answer, or ``finish_reason=length`` (the answer was cut off);
- ``distractor``: the answer gives another value stated in the prompt (which value, at which depth);
- ``cross_case``: the answer gives another case's expected value, a value this prompt never states
  (which case, sent how long before, over the same connection or not): an answer that belongs to
  another request, the mark of a cache or of state reused across requests;
- ``near_miss``: a number at edit distance 1-2 from the expected value (the wrong-digit class);
- ``partial``: a number that starts with a right prefix and then goes wrong (first wrong position),
  or, for several expected values, some but not all of them;
- ``refusal``: "not found", "I don't know" and the like;
- ``unrelated``: anything else (a fluent answer about something else).

A request that failed is ``error`` and never a miss; a right answer has no class. Pure functions.

Chance: a wrong d-digit answer matches one of V other cases' values by luck with probability
about V / 10^d; ``summarize_failures`` tests the cross-case count against that rate (exact
binomial tail) and calls it significant below ``CROSS_CASE_ALPHA``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from statistics import median

from needlescope.cases.scoring import answer_tokens, strip_reasoning

from .stats import binomial_tail

__all__ = [
    "CLASSES",
    "CROSS_CASE_ALPHA",
    "CaseIndex",
    "Failure",
    "classify",
    "edit_distance",
    "summarize_failures",
    "prompt_values",
]

CROSS_CASE_ALPHA = 0.01
CLASSES = (
    "distractor",
    "cross_case",
    "near_miss",
    "partial",
    "refusal",
    "empty_or_length",
    "reasoning_exhausted",
    "unrelated",
)
_NUMBER = re.compile(r"\d+")
_REFUSAL = re.compile(
    r"\b(?:don'?t know|do not know|not (?:found|mentioned|stated|provided|given|present)|"
    r"no (?:information|mention|such)|cannot|can'?t|unable|could not|couldn'?t|sorry|unknown|"
    r"there is no|isn'?t (?:mentioned|stated))\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Failure:
    """The class of one miss and its evidence (fields not relevant to the class stay None)."""

    category: str
    value: str | None = None
    """The wrong value the answer gave (distractor, near miss, partial)."""
    distractor_depth: float | None = None
    """Where the distractor value stands in the prompt, in percent of its characters."""
    edit_distance: int | None = None
    first_wrong: int | None = None
    """0-based position of the first wrong digit of a partial (or near-miss) value."""
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, {})}


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions and substitutions cost 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _first_wrong(value: str, expected: str) -> int:
    for i, (x, y) in enumerate(zip(value, expected)):
        if x != y:
            return i
    return min(len(value), len(expected))


def prompt_values(messages: Sequence[dict]) -> list[tuple[str, float]]:
    """Every number stated in the prompt with its depth (percent of the prompt's characters).

    The generated filler has no digits, so numbers in the prompt are needle and distractor values.
    """
    texts = [str(m.get("content") or "") for m in messages]
    total = sum(len(t) + 1 for t in texts) or 1
    out = []
    offset = 0
    for t in texts:
        for m in _NUMBER.finditer(t):
            out.append((m.group(), 100.0 * (offset + m.start()) / total))
        offset += len(t) + 1
    return out


def classify(
    *,
    answer: str | None,
    expected: Sequence[str],
    finish_reason: str | None = None,
    reasoning: str | None = None,
    messages: Sequence[dict] = (),
    other_case: Callable[[str], dict | None] | None = None,
) -> Failure:
    """The failure class of a scored miss (call it only for ok rows that are not correct).

    ``other_case(value)``: the evidence that ``value`` is another case's expected value (a
    :meth:`CaseIndex.source`), or None; without it no answer is classed ``cross_case``.
    """
    # Read the answer as the scorer does (cases.scoring): after any reasoning block, with the
    # digits of any script, so a miss's numbers are the ones that made it a miss.
    text = strip_reasoning(answer or "").strip()
    if not text:
        if finish_reason == "length" and (reasoning or "").strip():
            return Failure("reasoning_exhausted", detail={"reasoning_chars": len(reasoning or "")})
        return Failure("empty_or_length", detail={"finish_reason": finish_reason})
    if finish_reason == "length":
        return Failure("empty_or_length", detail={"finish_reason": "length"})
    numbers = [t for t in answer_tokens(text) if t.isdigit()]
    expected = [e.strip() for e in expected]
    wrong = [x for x in numbers if x not in expected]
    stated = {}
    for v, depth in prompt_values(messages):
        stated.setdefault(v, depth)
    for x in wrong:
        if x in stated:
            return Failure("distractor", value=x, distractor_depth=round(stated[x], 2))
    for x in wrong if other_case is not None else ():
        source = other_case(x)
        if source is not None:
            return Failure("cross_case", value=x, detail=source)
    for x in wrong:
        for e in expected:
            d = edit_distance(x, e)
            if 1 <= d <= 2:
                return Failure("near_miss", value=x, edit_distance=d, first_wrong=_first_wrong(x, e))
    for x in wrong:
        for e in expected:
            pos = _first_wrong(x, e)
            if pos > 0:
                return Failure("partial", value=x, edit_distance=edit_distance(x, e), first_wrong=pos)
    found = [e for e in expected if e in numbers]
    if found:
        return Failure("partial", detail={"values_found": len(found), "values_expected": len(expected)})
    if _REFUSAL.search(text):
        return Failure("refusal")
    return Failure("unrelated")


def sent_at(row: dict) -> float | None:
    """When a result row's request was first sent (epoch seconds): finished minus latency."""
    done, latency = row.get("finished_at"), row.get("latency_s")
    return None if done is None or latency is None else float(done) - float(latency)


class CaseIndex:
    """Every case of a run by the values it expects, with when and over which connection it went.

    ``rows`` are result rows (``case_id``, ``expected``, ``finished_at``, ``latency_s``,
    ``connection``); an errored case was sent too, so it can be a source.
    """

    def __init__(self, rows: Iterable[dict]) -> None:
        self._by_value: dict[str, list[dict]] = {}
        for r in rows:
            sent = {"case_id": r["case_id"], "sent_at": sent_at(r), "connection": r.get("connection")}
            for v in dict.fromkeys(str(e).strip() for e in r.get("expected") or ()):
                self._by_value.setdefault(v, []).append(sent)

    def source(self, row: dict, value: str) -> dict | None:
        """The case ``value`` most likely came from, for the answer of ``row``; None if no case expects it.

        The latest case sent before ``row`` that expects ``value`` (a stale answer comes from the
        past); if none was sent before, the first sent after it (negative ``sent_before_s``).
        """
        others = [s for s in self._by_value.get(value, ()) if s["case_id"] != row["case_id"]]
        if not others:
            return None
        t = sent_at(row)
        timed = [s for s in others if s["sent_at"] is not None and t is not None]
        before = [s for s in timed if s["sent_at"] <= t]
        src = (
            max(before, key=lambda s: s["sent_at"])
            if before
            else min(timed, key=lambda s: s["sent_at"])
            if timed
            else others[0]
        )
        own = row.get("connection")
        same = None if own is None or src["connection"] is None else own == src["connection"]
        return {
            "source_case": src["case_id"],
            "sent_before_s": None if src["sent_at"] is None or t is None else round(t - src["sent_at"], 3),
            "same_connection": same,
        }


def _cross_case_summary(rows: list[dict], cross: list[dict], values: int) -> dict:
    """The cross-case count against chance: wrong values of d digits that hit another case's value."""
    digits = max((len(str(e).strip()) for r in rows for e in r.get("expected") or ()), default=1)
    wrong = sum(
        1
        for r in rows
        if r.get("status") == "ok"
        and r.get("failure")
        and any(len(x) == digits and x not in r["expected"] for x in _NUMBER.findall(r.get("answer") or ""))
    )
    chance = min(1.0, max(0, values - 1) / 10**digits)
    p = binomial_tail(len(cross), wrong, chance)
    lags = [c["sent_before_s"] for c in cross if c.get("sent_before_s") is not None]
    same = [c.get("same_connection") for c in cross]
    return {
        "count": len(cross),
        "wrong_values": wrong,
        "chance": chance,
        "p_value": p,
        "significant": len(cross) >= 2 and p < CROSS_CASE_ALPHA,
        "same_connection": same.count(True),
        "other_connection": same.count(False),
        "connection_unknown": same.count(None),
        "sources": len({c["source_case"] for c in cross}),
        "sent_before_s_median": median(lags) if lags else None,
    }


def summarize_failures(rows: Iterable[dict], *, examples_per_class: int = 3) -> dict:
    """Counts per class, errors apart, a few examples per class from rows with a ``failure``, and
    the cross-case answers tested against chance (``cross_case``).

    Rows are result rows: ``status``, ``correct``, ``case_id``, ``answer``, ``expected`` and, for
    misses, ``failure`` (a :meth:`Failure.to_dict`).
    """
    rows = list(rows)
    counts = dict.fromkeys(CLASSES, 0)
    examples: dict[str, list[dict]] = {c: [] for c in CLASSES}
    cross: list[dict] = []
    errors = misses = 0
    for r in rows:
        if r.get("status") != "ok":
            errors += 1
            continue
        fail = r.get("failure")
        if r.get("correct") or not fail:
            continue
        misses += 1
        cat = fail["category"]
        counts[cat] += 1
        if cat == "cross_case":
            cross.append(fail.get("detail") or {})
        if len(examples[cat]) < examples_per_class:
            examples[cat].append(
                {
                    "case_id": r.get("case_id"),
                    "length": r.get("length"),
                    "depth": r.get("depth"),
                    "expected": list(r.get("expected") or []),
                    "answer": (r.get("answer") or "")[:200],
                    **{k: v for k, v in fail.items() if k not in ("category", "detail")},
                    **(fail.get("detail") or {}),
                }
            )
    values = len({str(e).strip() for r in rows for e in r.get("expected") or ()})
    return {
        "misses": misses,
        "errors": errors,
        "counts": counts,
        "examples": {c: e for c, e in examples.items() if e},
        "cross_case": _cross_case_summary(rows, cross, values),
    }
