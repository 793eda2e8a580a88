"""Two endpoints that differ only in ``index_topk``: what recall does when the top-k grows.

The black box's one experiment on the selection itself (issue 53: ``ranking_uninformative``'s
experiment from outside). The user serves the same deployment twice, the second with a larger
``index_topk`` (SGLang / vLLM ``--index-topk``, our ``serve --index-topk``); ``measure.blackbox``
sends the same cases to both (paired) and ``topk_pair_findings`` reads them. Pure, torch-free.

At a prompt of ``L`` tokens the indexer's last prompt position sees ``E = L // ratio`` entries
(``dsa.reference.visible_entries``); an endpoint whose top-k is at least ``E`` selects every entry there (**dense**),
one whose top-k is smaller chooses (**selective**). Per length the pair is one of:

``B dense``       the larger top-k selects every entry, the smaller chooses: a loss that stays at
                  B is no loss of the selection (``outside_selection``, the rule
                  ``topk_outside``); a loss B restores (paired exact McNemar p < 0.05, more
                  gained than lost) is the selection's: ``outside_selection`` is ruled out. So is
                  a loss B restores pooled over every length where A chooses (dense or not): a
                  loss outside the selection does not depend on how many entries are selected
                  (measured: ``key_cache_shift2.py`` restores 5 of 6 at B's dense length, p =
                  0.06, and 13 of 24 over all three, p = 2e-4)
``both selective``  B restores: the needle is ranked, below A's cut and within B's for the cases
                  B regained: a selection that drops the needle whatever its size
                  (``needle_excluded``: dropped candidates, a mask) would keep it out at B as
                  well, so ``needle_excluded`` is ruled out; B regains none of the cases A lost
                  while a dense top-k restores them: the needle ranks below B's cut in every one,
                  and a ranking that places it at chance (uniform over the entries: a scorer that
                  carries nothing, a misaddressed key read) would have regained each with
                  probability ``(kB - kA) / (E - kA)`` (one needle entry deciding the answer), so
                  with ``p_chance`` = the product of ``(E - kB) / (E - kA)`` over the lost cases
                  below 0.05 ``misaddressed`` (the needle scored with another entry's key: at
                  chance for the needle) is ruled out: the needle is excluded whatever the top-k
                  (``needle_excluded``) or ranked below chance (``ranking_uninformative``'s
                  inverted form: a flipped sign), which the capture tells apart

What the pair cannot do: tell ``ranking_uninformative`` from ``misaddressed`` (both rank the
needle at chance from outside: a shifted key read is a random one for the needle) or
``needle_excluded`` from a ranking below chance. It **narrows**: ``ruled_out`` names each
class it excludes with the length and test, ``narrowed_to`` the selection classes left, and the
characterization stays ``undecided`` naming the capture for them (docs/signatures.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from needlescope.analysis.stats import mcnemar_exact

__all__ = [
    "TOPK_RULES",
    "PairCell",
    "TopkPair",
    "entries",
    "pair_lengths",
    "pair_readings",
    "pair_summary",
    "topk_outside",
    "topk_ruled_out",
]

TOPK_RULES = {
    "alpha": 0.05,
    "both_selective_lost_at_least": 3,  # A's losses at lengths both select before "regains none" is read
}


@dataclass(frozen=True)
class PairCell:
    """The same ``n`` cases at one prompt length on both endpoints: ``a_lost`` / ``b_lost``
    answered wrong by the smaller / larger top-k, ``gained`` wrong at A and right at B,
    ``dropped`` right at A and wrong at B."""

    length: int
    n: int
    a_lost: int
    b_lost: int
    gained: int
    dropped: int


@dataclass(frozen=True)
class TopkPair:
    """The pair's measurements (``measure.blackbox`` fills it): the endpoints' top-k
    (``topk_a`` < ``topk_b``), their shared compression ratio, where B's top-k came from, a
    ``PairCell`` per length, and ``errors``: cases one endpoint answered with an error (unpaired,
    left out of the cells)."""

    endpoint_b: str
    topk_a: int
    topk_b: int
    ratio: int
    source_b: str
    cells: tuple[PairCell, ...] = ()
    errors: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> TopkPair:
        return cls(**{**obj, "cells": tuple(PairCell(**c) for c in obj.get("cells", []))})


def entries(length: int, ratio: int) -> int:
    """Compressed entries the last position of a ``length``-token prompt sees: ``length // ratio``
    (the rule of ``dsa.reference.visible_entries``, which ``decide`` may not import: torch)."""
    return length // ratio


def pair_lengths(ratio: int, topk_a: int, topk_b: int) -> list[int]:
    """The lengths the pair is measured at besides the symptom's: B's dense length
    (``ratio x topk_b - 1``: B selects every entry, A about ``topk_a / topk_b`` of them) and
    twice B's capacity (both choose; a chance ranking regains ``(kB - kA) / (E - kA)`` of A's
    losses there, a third when ``kB = 2 kA``)."""
    return [ratio * topk_b - 1, 2 * ratio * topk_b]


def _regime(length: int, ratio: int, topk: int) -> str:
    return "dense" if entries(length, ratio) <= topk else "selective"


def pair_readings(pair: TopkPair) -> list[dict]:
    """Per length, shortest first: both regimes, the counts, McNemar (B vs A) and whether B
    restores (p < alpha and more gained than dropped)."""
    out = []
    for c in sorted(pair.cells, key=lambda c: c.length):
        p = mcnemar_exact(c.gained, c.dropped)
        out.append(
            {
                **asdict(c),
                "entries": entries(c.length, pair.ratio),
                "a": _regime(c.length, pair.ratio, pair.topk_a),
                "b": _regime(c.length, pair.ratio, pair.topk_b),
                "p": p,
                "restores": p < TOPK_RULES["alpha"] and c.gained > c.dropped,
            }
        )
    return out


def _pooled(rows: list[dict]) -> dict:
    n = sum(r["n"] for r in rows)
    gained, dropped = sum(r["gained"] for r in rows), sum(r["dropped"] for r in rows)
    p = mcnemar_exact(gained, dropped)
    return {
        "lengths": [r["length"] for r in rows],
        "n": n,
        "a_lost": sum(r["a_lost"] for r in rows),
        "b_lost": sum(r["b_lost"] for r in rows),
        "gained": gained,
        "dropped": dropped,
        "p": p,
        "restores": p < TOPK_RULES["alpha"] and gained > dropped,
    }


def topk_outside(pair: TopkPair | None) -> dict | None:
    """``outside_selection`` from the pair: at the lengths where the larger top-k selects every
    entry and the smaller chooses, B still loses, exact one-sided p = 0.5 ** lost < alpha (the
    dense rule's null: no loss where the selection is every entry)."""
    if pair is None:
        return None
    rows = [r for r in pair_readings(pair) if r["b"] == "dense" and r["a"] == "selective"]
    lost = sum(r["b_lost"] for r in rows)
    p = 0.5**lost if lost else 1.0
    if not rows or p >= TOPK_RULES["alpha"]:
        return None
    return {
        "rule": f"recall lost where the larger top-k ({pair.topk_b}) selects every entry",
        "experiment": f"two endpoints that differ only in top-k ({pair.topk_a} vs {pair.topk_b}): "
        f"recall at {', '.join(str(r['length']) for r in rows)} tokens",
        "length": rows[0]["length"],
        "lost": lost,
        "n": sum(r["n"] for r in rows),
        "p": p,
        "null": "no loss where the selection is dense (exact, one-sided)",
    }


def _p_chance(rows: list[dict], pair: TopkPair) -> float:
    """P(B regains none of A's losses) under a ranking at chance with one needle entry deciding
    the answer: each lost case's entry lies below A's cut, uniform over the ``E - kA`` others,
    and stays out at B with probability ``(E - kB) / (E - kA)``."""
    out = 1.0
    for r in rows:
        e = r["entries"]
        out *= ((e - pair.topk_b) / (e - pair.topk_a)) ** r["a_lost"]
    return out


def topk_ruled_out(pair: TopkPair | None) -> dict[str, dict]:
    """class -> why the pair rules it out (module docstring), each with its lengths and test;
    {} without a pair or when nothing is ruled out."""
    if pair is None:
        return {}
    rows = pair_readings(pair)
    dense_b = _pooled([r for r in rows if r["b"] == "dense" and r["a"] == "selective"])
    both = [r for r in rows if r["b"] == "selective"]
    both_pooled = _pooled(both)
    out: dict[str, dict] = {}
    if dense_b["lengths"] and dense_b["restores"]:
        out["outside_selection"] = {
            "rule": f"selecting every entry (top-k {pair.topk_b}) restores what top-k {pair.topk_a} lost",
            **dense_b,
            "null": "the larger top-k wins no more cases than it loses (exact McNemar)",
        }
    else:
        chose = _pooled([r for r in rows if r["a"] == "selective"])
        if chose["lengths"] and chose["restores"]:
            out["outside_selection"] = {
                "rule": f"the larger top-k ({pair.topk_b}) restores what top-k {pair.topk_a} lost, pooled over "
                "every length where the smaller chooses: the loss depends on how many entries are selected",
                **chose,
                "null": "the larger top-k wins no more cases than it loses (exact McNemar)",
            }
    if both and both_pooled["restores"]:
        out["needle_excluded"] = {
            "rule": f"the larger top-k restores cases at lengths where both choose: the needle is ranked, "
            f"below top-{pair.topk_a}'s cut and within top-{pair.topk_b}'s",
            **both_pooled,
            "null": "the larger top-k wins no more cases than it loses (exact McNemar)",
        }
    inside = dense_b["restores"] or "outside_selection" in out
    if (
        both
        and inside
        and both_pooled["gained"] == 0
        and both_pooled["a_lost"] >= TOPK_RULES["both_selective_lost_at_least"]
    ):
        p = _p_chance(both, pair)
        if p < TOPK_RULES["alpha"]:
            why = {
                "rule": f"the larger top-k regains none of the {both_pooled['a_lost']} cases top-{pair.topk_a} "
                "lost where both choose, while selecting every entry restores them: the needle ranks below "
                f"top-{pair.topk_b}'s cut in every one",
                **both_pooled,
                "p_chance": p,
                "null": "a ranking that places the needle at chance regains each lost case with probability "
                "(kB - kA) / (E - kA) (one needle entry deciding the answer)",
            }
            # ranking_uninformative stays: a ranking below chance (an inverted sign) regains none either
            out["misaddressed"] = why
    return out


def pair_summary(pair: TopkPair) -> dict:
    """The pair's evidence as ``characterization.topk_pair`` writes it."""
    return {
        "endpoint_b": pair.endpoint_b,
        "topk": [pair.topk_a, pair.topk_b],
        "topk_b_from": pair.source_b,
        "ratio": pair.ratio,
        "errors": pair.errors,
        "lengths": [
            {
                k: r[k]
                for k in ("length", "entries", "a", "b", "n", "a_lost", "b_lost", "gained", "dropped", "p")
            }
            for r in pair_readings(pair)
        ],
    }
