"""The uninformative-ranking rule: is the indexer's ranking of the needle better than chance,
and does the collapse length track ``compress_ratio x index_topk``? Pure functions.

**Rank percentile.** At one query, ``v`` entries are visible, ``m`` of them cover the needle,
and ``j = best_rank - 1`` non-needle entries score at or above the best needle entry. If the
ranking carried no information about the needle, the needle entries would sit at random
places: ``P(J >= a) = C(v - a, m) / C(v, m)``. The mid-p percentile
``u = P(J < j) + P(J = j) / 2`` is then (close to) uniform on (0, 1); an informative ranking
puts the needle near the top (``u`` near 0).

**Test (per CSA layer).** One-sample Kolmogorov-Smirnov of the ``u`` values against U(0, 1)
(two-sided, exact p-value for the sample size). The layer's ranking is **uninformative** when
at least ``MIN_RANKED`` values were tested and the test does *not* reject uniformity at
``ALPHA``, or when it rejects with the median ``u`` above 0.5 (the needle is pushed *down*,
worse than chance). The values come from the failing cases at their first wrong answer token
when there are at least ``MIN_RANKED`` of them; otherwise from every case whose query sees
more entries than ``index_topk`` (where the ranking decides anything), at its first answer
token. The population used is recorded.

**Collapse vs top-k.** For each run that differs from the candidate only in ``index_topk``
(and the candidate itself), capacity ``C = compress_ratio x index_topk`` tokens. The run is
*consistent* when recall holds (>= ``HOLD``) at every tested length <= C and falls below it at
the first tested length > C; ``None`` when no tested length exceeds C. The collapse tracks
top-k when at least two runs with different ``index_topk`` are consistent and none is not.

The rule **fires** when some layer's ranking is uninformative and the collapse tracks top-k.
"""

from __future__ import annotations

import math

from scipy.stats import kstest

__all__ = [
    "ALPHA",
    "MIN_RANKED",
    "HOLD",
    "rank_percentile",
    "layer_ranking",
    "collapse_runs",
    "signature",
    "tracks_topk",
]

ALPHA = 0.05
MIN_RANKED = 8
HOLD = 0.85
"""Recall that counts as holding (the probe's effective-length threshold)."""


def rank_percentile(best_rank: int, visible: int, needle_visible: int) -> float:
    """Mid-p percentile of the best needle entry's rank under a random ranking (see module doc)."""
    v, m, j = visible, needle_visible, best_rank - 1
    if not (1 <= m <= v and 0 <= j <= v - m):
        raise ValueError(f"inconsistent rank: best_rank {best_rank}, visible {v}, needle entries {m}")
    total = math.comb(v, m)

    def at_least(a: int) -> float:
        return math.comb(v - a, m) / total if a <= v - m else 0.0

    return (1.0 - at_least(j)) + 0.5 * (at_least(j) - at_least(j + 1))


def layer_ranking(records: list[dict]) -> list[dict]:
    """Per CSA layer, the uniformity test over measured case records (``measure`` schema)."""
    failing = [r for r in records if not r["correct"] and r["analysed_source"] == "first wrong answer token"]
    if len(failing) >= MIN_RANKED:
        pool, population = failing, "failing cases, first wrong answer token"
    else:
        pool = records
        population = "all cases with more visible entries than index_topk, first answer token"
    by_layer: dict[int, list[float]] = {}
    for r in pool:
        for layer in r["layers"]:
            if population.startswith("all") and (
                r["analysed_token"] != 0 or layer["visible"] <= r["index_topk"]
            ):
                continue
            by_layer.setdefault(layer["layer"], []).append(
                rank_percentile(layer["best_rank"], layer["visible"], layer["needle_visible"])
            )
    out = []
    for layer, us in sorted(by_layer.items()):
        n = len(us)
        median = sorted(us)[n // 2] if n else None
        if n >= MIN_RANKED:
            res = kstest(us, "uniform", method="exact")
            stat, p = float(res.statistic), float(res.pvalue)
            uninformative = p >= ALPHA or (median is not None and median > 0.5)
        else:
            stat = p = None
            uninformative = False
        out.append(
            {
                "layer": layer,
                "n": n,
                "population": population,
                "ks_statistic": stat,
                "p_value": p,
                "median_percentile": median,
                "uninformative": uninformative,
            }
        )
    return out


def collapse_runs(runs: list[dict]) -> list[dict]:
    """``runs``: [{"index_topk": int, "compress_ratio": int, "recall": {length: float}}] -> with
    capacity, last length holding, first length collapsed, and ``consistent`` (see module doc)."""
    out = []
    for run in sorted(runs, key=lambda r: r["index_topk"]):
        cap = run["compress_ratio"] * run["index_topk"]
        rec = {int(k): v for k, v in run["recall"].items()}
        lengths = sorted(rec)
        holding = [n for n in lengths if rec[n] >= HOLD]
        below = [n for n in lengths if rec[n] < HOLD]
        beyond = [n for n in lengths if n > cap]
        consistent = None
        if beyond:
            consistent = all(rec[n] >= HOLD for n in lengths if n <= cap) and rec[beyond[0]] < HOLD
        out.append(
            {
                "index_topk": run["index_topk"],
                "capacity_tokens": cap,
                "recall": {str(n): rec[n] for n in lengths},
                "last_holding": max(
                    (n for n in holding if all(rec[m] >= HOLD for m in lengths if m <= n)), default=None
                ),
                "first_collapsed": min(below, default=None),
                "consistent": consistent,
            }
        )
    return out


def signature(records: list[dict], topk_runs: list[dict]) -> dict:
    """``{"uninformative_ranking": bool, "layers": [...], "collapse_vs_topk": [...]}``: the rule fires
    (``uninformative_ranking`` true) when a layer is uninformative and the collapse tracks top-k."""
    layers = layer_ranking(records)
    runs = collapse_runs(topk_runs)
    fires = tracks_topk(runs) and any(layer["uninformative"] for layer in layers)
    return {"uninformative_ranking": bool(fires), "layers": layers, "collapse_vs_topk": runs}


def tracks_topk(runs: list[dict]) -> bool:
    """Whether ``collapse_runs`` output shows the collapse tracking top-k (see module doc)."""
    judged = [r for r in runs if r["consistent"] is not None]
    return len({r["index_topk"] for r in judged if r["consistent"]}) >= 2 and all(
        r["consistent"] for r in judged
    )
