"""The ranking signature: is the indexer's ranking of the needle better than chance, near
chance, or systematically worse, and does the collapse length track ``compress_ratio x
index_topk``? Pure functions (docs/signature.md has the operating characteristics).

**Population (outcome-blind).** Every case whose query sees more entries than ``index_topk``
(where the ranking decides anything), at the **first answer token** (the last prompt position:
fixed before the answer is known). A case's outcome never chooses whether or where it is
measured: a case fails largely *because* its needle ranked low, so ranks taken at failures (or
only from failing cases) look worse than the indexer is.

**Rank percentile.** At one query, ``v`` entries are visible, ``m`` of them cover the needle,
and ``j = best_rank - 1`` non-needle entries score at or above the best needle entry. Under a
random ranking ``P(J >= a) = C(v - a, m) / C(v, m)``. The percentile is the randomized
probability integral transform ``u = P(J < j) + w P(J = j)``, ``w`` a fixed pseudo-random draw
in (0, 1) from the case id and layer (so it is reproducible and blind to the outcome). Under a
random ranking ``u`` is exactly U(0, 1) however few entries are visible; the plain mid-p value
(``w = 1/2``) is not (variance 0.035 instead of 1/12 at v = 6, m = 5). ``u`` near 0: the needle
ranks near the top.

**Tests (per CSA layer, Holm-corrected across layers, each family on its own).**

- *better than chance*: the exact lower tail of ``S = sum(u)`` under independent U(0, 1) values
  (the Irwin-Hall distribution, Edgington's method; exact rational arithmetic up to
  ``EXACT_MAX_N`` values, its normal limit above);
- *worse than chance*: the upper tail of the same statistic;
- *near chance* (equivalence): the one-sided t-test of ``H0: mean u <= 0.5 - NEAR_CHANCE``.

Effect size: the mean percentile with its one-sided 95% bounds (t), and the median.

**Classes.** ``excluded`` (the needle is systematically excluded: worse than chance, and the
lower bound of the mean percentile at least ``0.5 + NEAR_CHANCE``; the likely bug classes are
masking, validity flags and dropped candidates); ``uninformative`` (the data bound the mean
percentile within ``NEAR_CHANCE`` of chance or above: a failure to reject is never enough);
``informative`` (better than chance, and not bounded near it); ``undecided`` (too few cases
to tell; ``cases_needed`` says about how many would).

**Collapse vs top-k** (``collapse_runs``, ``tracks_topk``). Each run that differs from the
candidate only in ``index_topk`` (the candidate included) has capacity ``C = compress_ratio x
index_topk`` tokens. At each tested length its recall **holds** when the Wilson 95% interval
lies above ``HOLD``, has **collapsed** when it lies below, and is *unclear* otherwise. A run is
*consistent* when it holds at a tested length ``<= C``, collapses at none ``<= C``, and collapses
at a tested length ``> C``; *not consistent* when it collapses at or below its capacity or
never holds at any tested length; otherwise undecided. A larger top-k **moves** the collapse
when, at a tested length ``L`` with ``C_small < L <= C_large`` (at ``L = C_large`` the larger
top-k covers every visible entry), the smaller run has collapsed and the larger one holds.
The collapse **tracks top-k** when the smallest run is consistent, a larger run moves its
collapse, and no run is inconsistent; it is **not tracking** when some run is inconsistent (a
larger run that collapses where the smaller did collapses within its own capacity); otherwise
the rule cannot decide.

**Top-k fix.** Each larger-top-k run is paired case by case with the smallest (exact McNemar);
it *restores* recall when ``p < ALPHA`` and it wins more discordant cases than it loses. Only a
measured restoring top-k fix makes "raising index_topk is a workaround" true.

**The rule fires** (``uninformative_ranking``) when some layer is ``uninformative`` and the
collapse tracks top-k: a functional indexer bug, not precision. ``excluded`` is reported on its
own (it needs no collapse pattern).
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from statistics import NormalDist, median

from scipy.stats import t as student_t

from needlescope.analysis.significance import holm
from needlescope.analysis.stats import mcnemar_exact, wilson_interval
from needlescope.investigate.decide.verdicts import ALPHA, restores

__all__ = [
    "ALPHA",
    "NEAR_CHANCE",
    "HOLD",
    "EXACT_MAX_N",
    "rank_percentile",
    "case_draw",
    "sum_uniform_cdf",
    "percentile_stats",
    "layer_percentiles",
    "layer_ranking",
    "cases_needed",
    "collapse_runs",
    "tracks_topk",
    "topk_fix",
    "signature",
    "NO_SIGNATURE",
]

NEAR_CHANCE = 0.15
"""Equivalence margin: a mean percentile of at least 0.5 - NEAR_CHANCE counts as near chance."""
HOLD = 0.85
"""Recall that counts as holding (the probe's effective-length threshold)."""
EXACT_MAX_N = 400
"""Up to this many percentiles the Irwin-Hall tail is exact; above, its normal limit (error < 1e-4)."""
POPULATION = "every case with more visible entries than index_topk, at the first answer token"


def rank_percentile(best_rank: int, visible: int, needle_visible: int, draw: float = 0.5) -> float:
    """Randomized percentile ``P(J < j) + draw * P(J = j)`` of the best needle entry's rank under
    a random ranking (module doc); ``draw = 0.5`` is the mid-p value."""
    v, m, j = visible, needle_visible, best_rank - 1
    if not (1 <= m <= v and 0 <= j <= v - m):
        raise ValueError(f"inconsistent rank: best_rank {best_rank}, visible {v}, needle entries {m}")
    if not 0.0 <= draw <= 1.0:
        raise ValueError(f"draw must lie in [0, 1]; got {draw}")
    total = math.comb(v, m)

    def at_least(a: int) -> float:  # 0 past v - m: math.comb is 0 when asked for more than there are
        return math.comb(v - a, m) / total

    return (1.0 - at_least(j)) + draw * (at_least(j) - at_least(j + 1))


def case_draw(case_id: str, layer: int) -> float:
    """A reproducible U(0, 1) draw from the case id and layer (never 0 or 1)."""
    h = int.from_bytes(hashlib.sha256(f"{case_id}/{layer}".encode()).digest()[:8], "big")
    return (h + 0.5) / 2**64


def sum_uniform_cdf(s: float, n: int) -> float:
    """``P(U_1 + ... + U_n <= s)`` for independent U(0, 1) values (Irwin-Hall), exact up to
    ``EXACT_MAX_N`` terms (rational arithmetic on the float ``s``), the normal limit above."""
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    if s <= 0:
        return 0.0
    if s >= n:
        return 1.0
    if n > EXACT_MAX_N:
        return NormalDist(n / 2, math.sqrt(n / 12)).cdf(s)
    if s > n / 2:
        return 1.0 - sum_uniform_cdf(n - s, n)
    x = Fraction(s)
    total = sum((-1) ** k * math.comb(n, k) * (x - k) ** n for k in range(math.floor(s) + 1))
    return float(total / math.factorial(n))


def percentile_stats(us: list[float]) -> dict:
    """Tests and effect size of one layer's percentiles (module doc), before correction."""
    n = len(us)
    out = {
        "n": n,
        "mean_percentile": None,
        "mean_lower": None,
        "mean_upper": None,
        "median_percentile": None,
        "p_better": 1.0,
        "p_worse": 1.0,
        "p_near_chance": 1.0,
    }
    if n == 0:
        return out
    s = math.fsum(us)
    mean = s / n
    out.update(
        mean_percentile=mean,
        median_percentile=median(us),
        p_better=sum_uniform_cdf(s, n),
        p_worse=sum_uniform_cdf(n - s, n),
    )
    if n >= 2:
        sd = math.sqrt(math.fsum((u - mean) ** 2 for u in us) / (n - 1))
        se = max(sd, 1e-12) / math.sqrt(n)
        q = float(student_t.ppf(1 - ALPHA, n - 1))
        out.update(
            mean_lower=max(0.0, mean - q * se),
            mean_upper=min(1.0, mean + q * se),
            p_near_chance=float(student_t.sf((mean - (0.5 - NEAR_CHANCE)) / se, n - 1)),
        )
    return out


def cases_needed(layers: int = 1) -> int:
    """Cases per layer at which a chance ranking (percentiles U(0, 1)) is bounded near chance
    with 80% power at one-sided ``ALPHA / layers`` (the strictest Holm level):
    ((z + z_0.8) sd / NEAR_CHANCE)^2 + 1, sd = sqrt(1/12), a normal approximation."""
    z = NormalDist().inv_cdf
    return math.ceil(((z(1 - ALPHA / max(1, layers)) + z(0.8)) * math.sqrt(1 / 12) / NEAR_CHANCE) ** 2) + 1


def _first_token_layers(record: dict) -> list[dict] | None:
    """The layers measured at the first answer token (older records: only when analysed there)."""
    if "first_token_layers" in record:
        return record["first_token_layers"]
    return record["layers"] if record["analysed_token"] == 0 else None


def layer_percentiles(records: list[dict]) -> dict[int, list[float]]:
    """CSA layer -> the percentiles of the outcome-blind population (module doc)."""
    by_layer: dict[int, list[float]] = {}
    for r in records:
        for layer in _first_token_layers(r) or []:
            if layer["visible"] <= r["index_topk"]:
                continue
            by_layer.setdefault(layer["layer"], []).append(
                rank_percentile(
                    layer["best_rank"],
                    layer["visible"],
                    layer["needle_visible"],
                    case_draw(r["case_id"], layer["layer"]),
                )
            )
    return by_layer


def layer_ranking(records: list[dict]) -> list[dict]:
    """Per CSA layer: percentiles of the outcome-blind population, tests, Holm, class."""
    by_layer = layer_percentiles(records)
    rows = [
        {"layer": layer, "population": POPULATION, **percentile_stats(us)}
        for layer, us in sorted(by_layer.items())
    ]
    for key in ("p_better", "p_worse", "p_near_chance"):
        for row, p in zip(rows, holm([r[key] for r in rows]), strict=True):
            row[key + "_holm"] = p
    for row in rows:
        row["ranking"] = _layer_class(row)
        row["uninformative"] = row["ranking"] == "uninformative"
        row["cases_needed"] = cases_needed(len(rows))
    return rows


def _layer_class(row: dict) -> str:
    if row["p_worse_holm"] < ALPHA and (row["mean_lower"] or 0.0) >= 0.5 + NEAR_CHANCE:
        return "excluded"
    if row["p_near_chance_holm"] < ALPHA:
        return "uninformative"
    if row["p_better_holm"] < ALPHA:
        return "informative"
    return "undecided"


def _state(k: int, n: int) -> str:
    lo, hi = wilson_interval(k, n)
    if n and lo > HOLD:
        return "holds"
    if n and hi < HOLD:
        return "collapsed"
    return "unclear"


def collapse_runs(runs: list[dict]) -> list[dict]:
    """``runs``: [{"index_topk", "compress_ratio", "cases": [{"case_id", "length", "correct"}]}]
    -> per run, sorted by index_topk: capacity, per-length counts, Wilson interval and state,
    ``last_holding``, ``first_collapsed`` and ``consistent`` (True / False / None; module doc)."""
    out = []
    for run in sorted(runs, key=lambda r: r["index_topk"]):
        cap = run["compress_ratio"] * run["index_topk"]
        counts: dict[int, list[int]] = {}
        for c in run["cases"]:
            kn = counts.setdefault(int(c["length"]), [0, 0])
            kn[0] += int(bool(c["correct"]))
            kn[1] += 1
        lengths = sorted(counts)
        state = {n: _state(*counts[n]) for n in lengths}
        inside = [state[n] for n in lengths if n <= cap]
        beyond = [state[n] for n in lengths if n > cap]
        consistent = None
        if "collapsed" in inside or (state and all(s == "collapsed" for s in state.values())):
            consistent = False
        elif "holds" in inside and "collapsed" in beyond:
            consistent = True
        holding = [n for n in lengths if state[n] == "holds"]
        out.append(
            {
                "index_topk": run["index_topk"],
                "capacity_tokens": cap,
                "recall": {str(n): counts[n][0] / counts[n][1] for n in lengths},
                "lengths": [
                    {
                        "length": n,
                        "correct": counts[n][0],
                        "n": counts[n][1],
                        "ci": list(wilson_interval(*counts[n])),
                        "state": state[n],
                    }
                    for n in lengths
                ],
                "last_holding": max(
                    (n for n in holding if all(state[m] != "collapsed" for m in lengths if m <= n)),
                    default=None,
                ),
                "first_collapsed": min((n for n in lengths if state[n] == "collapsed"), default=None),
                "consistent": consistent,
                "cases": {c["case_id"]: bool(c["correct"]) for c in run["cases"]},
            }
        )
    return out


def _moves(small: dict, large: dict) -> bool:
    """Whether ``large`` (more top-k) measurably moves ``small``'s collapse (module doc). A larger
    run that collapses at such a length collapses within its own capacity, so it is already
    inconsistent ("not tracking") before this is asked."""
    s_state = {x["length"]: x["state"] for x in small["lengths"]}
    l_state = {x["length"]: x["state"] for x in large["lengths"]}
    return any(
        s_state[n] == "collapsed" and l_state.get(n) == "holds"
        for n in s_state
        if small["capacity_tokens"] < n <= large["capacity_tokens"]
    )


def tracks_topk(runs: list[dict]) -> dict:
    """``{"tracks": True | False | None, "reason": str, "moved_by": [index_topk]}`` over
    ``collapse_runs`` output (module doc)."""
    if len({r["index_topk"] for r in runs}) < 2:
        return {"tracks": None, "reason": "fewer than two runs with different index_topk", "moved_by": []}
    bad = [r for r in runs if r["consistent"] is False]
    if bad:
        r = bad[0]
        why = (
            "never holds at any tested length"
            if r["last_holding"] is None
            else f"collapses at {r['first_collapsed']} tokens, within its capacity of {r['capacity_tokens']}"
        )
        return {
            "tracks": False,
            "reason": f"not tracking: index_topk {r['index_topk']} {why}",
            "moved_by": [],
        }
    base, larger = runs[0], runs[1:]
    moved_by = [r["index_topk"] for r in larger if _moves(base, r)]
    if base["consistent"] and moved_by:
        return {
            "tracks": True,
            "reason": f"recall holds up to index_topk {base['index_topk']}'s capacity and collapses past it; "
            f"index_topk {moved_by[0]} holds where it collapsed",
            "moved_by": moved_by,
        }
    return {
        "tracks": None,
        "reason": f"cannot decide: at no tested length between consecutive capacities do the Wilson "
        f"intervals show one run holding above {HOLD} and the smaller one collapsed below it (more cases "
        "per length, or a length between the capacities, would decide)",
        "moved_by": [],
    }


def topk_fix(runs: list[dict]) -> dict:
    """Each larger-top-k run paired with the smallest: ``{"restores": bool, "runs": [...]}``."""
    if len(runs) < 2:
        return {"restores": False, "runs": []}
    base = runs[0]["cases"]
    out = []
    for r in runs[1:]:
        ids = sorted(set(base) & set(r["cases"]))
        b = sum(1 for i in ids if not base[i] and r["cases"][i])
        c = sum(1 for i in ids if base[i] and not r["cases"][i])
        p = mcnemar_exact(b, c)
        out.append(
            {
                "index_topk": r["index_topk"],
                "n": len(ids),
                "b": b,
                "c": c,
                "p": p,
                "restores": restores({"p": p, "b": b, "c": c}),
            }
        )
    return {"restores": any(x["restores"] for x in out), "runs": out}


def signature(records: list[dict], topk_runs: list[dict]) -> dict:
    """The signature over the candidate's measured records (``measure`` schema) and the runs
    that differ from it only in ``index_topk``::

        {"uninformative_ranking": bool,   # the rule fires
         "excluded": bool,                # some layer systematically excludes the needle
         "ranking": "excluded" | "uninformative" | "informative" | "undecided",
         "collapse": {"tracks": bool | None, "reason": str, "moved_by": [int]},
         "topk_fix": {"restores": bool, "runs": [{"index_topk", "n", "b", "c", "p", "restores"}]},
         "layers": [per-layer rows of ``layer_ranking``],
         "collapse_vs_topk": [per-run rows of ``collapse_runs``, without the case outcomes]}
    """
    layers = layer_ranking(records)
    runs = collapse_runs(topk_runs)
    collapse = tracks_topk(runs)
    classes = {ly["ranking"] for ly in layers}
    ranking = next((c for c in ("excluded", "uninformative", "undecided") if c in classes), None)
    ranking = ranking or ("informative" if layers else "undecided")
    fires = collapse["tracks"] is True and "uninformative" in classes
    return {
        "uninformative_ranking": bool(fires),
        "excluded": "excluded" in classes,
        "ranking": ranking,
        "collapse": collapse,
        "topk_fix": topk_fix(runs),
        "layers": layers,
        "collapse_vs_topk": [{k: v for k, v in r.items() if k != "cases"} for r in runs],
    }


NO_SIGNATURE = {
    "uninformative_ranking": False,
    "excluded": False,
    "ranking": "undecided",
    "collapse": {"tracks": None, "reason": "nothing measured", "moved_by": []},
    "topk_fix": {"restores": False, "runs": []},
    "layers": [],
    "collapse_vs_topk": [],
}
