"""Operating characteristics of the ranking signature and the collapse rule (issue 28 items 1, 3).

    .venv/bin/python bench/signature_oc.py [--reps 2000]

**Ranking.** The model of the issue: at each query ``v`` entries are visible, 5 cover the needle,
non-needle scores are N(0, 1) and needle scores N(delta, 1); the best needle entry's rank is
drawn from that. Per repetition, two CSA layers (independent draws) of the demo's outcome-blind
population (6 cases at 512 tokens, v = 128, and 6 at 1,024, v = 256: 12 a layer), then larger
populations. Printed: how often the layer-corrected classification (``signature.layer_ranking``
and ``signature``'s "ranking") is each class, for delta = 0, 0.25, 0.5, 0.75.

**Collapse rule.** ``signature.tracks_topk`` on runs at index_topk 64 and 128 (capacities 256 and
512 tokens, compress ratio 4), lengths 256/512/1024, n cases a length:
- *no top-k dependence*: recall 0.95, 0.6, 0.3 at the three lengths in both runs;
- *tracks*: recall 0.98 within capacity, 0.3 beyond it;
- *self-consistent weak indexer*: a correct indexer whose ranking is informative at delta = 0.75,
  a case right exactly when its needle is selected (best rank <= index_topk).
Printed: how often the rule says "tracks" (True), "not tracking" (False), "cannot decide" (None).
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections import Counter

import numpy as np

from needlescope.investigate.decide.signature import collapse_runs, signature, tracks_topk


def best_rank(rng: random.Random, delta: float, v: int, m: int = 5) -> int:
    gen = np.random.default_rng(rng.getrandbits(64))
    best = (gen.standard_normal(m) + delta).max()
    return 1 + int((gen.standard_normal(v - m) > best).sum())


def records(rng: random.Random, delta: float, per_length: int) -> list[dict]:
    out = []
    for length, v in ((512, 128), (1024, 256)):
        for i in range(per_length):
            layers = [
                {"layer": layer, "best_rank": best_rank(rng, delta, v), "visible": v, "needle_visible": 5}
                for layer in (1, 3)
            ]
            out.append(
                {
                    "case_id": f"L{length}-{i}-{rng.random()}",
                    "correct": True,
                    "analysed_token": 0,
                    "index_topk": 64,
                    "layers": layers,
                    "first_token_layers": layers,
                }
            )
    return out


def ranking_table(reps: int, sizes: list[int]) -> None:
    print("| cases a layer | delta | mean u | uninformative | informative | excluded | undecided |")
    print("|---|---|---|---|---|---|---|")
    for per_length in sizes:
        for delta in (0.0, 0.25, 0.5, 0.75):
            rng = random.Random(int(1000 * delta) + per_length)
            counts: Counter = Counter()
            mean_u = 0.0
            for _ in range(reps):
                sig = signature(records(rng, delta, per_length), [])
                counts[sig["ranking"]] += 1
                mean_u += sum(ly["mean_percentile"] for ly in sig["layers"]) / len(sig["layers"]) / reps
            print(
                f"| {2 * per_length} | {delta} | {mean_u:.2f} | "
                + " | ".join(
                    f"{counts[c] / reps:.3f}"
                    for c in ("uninformative", "informative", "excluded", "undecided")
                )
                + " |",
                flush=True,
            )


def run_of(rng: random.Random, k: int, recall: dict[int, float], n: int) -> dict:
    cases = [
        {"case_id": f"{length}-{i}", "length": length, "correct": rng.random() < p}
        for length, p in recall.items()
        for i in range(n)
    ]
    return {"index_topk": k, "compress_ratio": 4, "cases": cases}


def weak_run(rng: random.Random, k: int, n: int, delta: float = 0.75) -> dict:
    cases = [
        {
            "case_id": f"{length}-{i}",
            "length": length,
            "correct": length // 4 <= k or best_rank(rng, delta, length // 4) <= k,
        }
        for length in (256, 512, 1024)
        for i in range(n)
    ]
    return {"index_topk": k, "compress_ratio": 4, "cases": cases}


def collapse_table(reps: int, sizes: list[int]) -> None:
    flat = {256: 0.95, 512: 0.6, 1024: 0.3}
    print("| cases a length | scenario | tracks | not tracking | cannot decide |")
    print("|---|---|---|---|---|")
    for n in sizes:
        for name in ("no top-k dependence", "tracks", "self-consistent weak indexer (delta 0.75)"):
            rng = random.Random(n)
            counts: Counter = Counter()
            for _ in range(reps):
                if name == "no top-k dependence":
                    runs = [run_of(rng, 64, flat, n), run_of(rng, 128, flat, n)]
                elif name == "tracks":
                    runs = [
                        run_of(rng, k, {x: 0.98 if x <= 4 * k else 0.3 for x in (256, 512, 1024)}, n)
                        for k in (64, 128)
                    ]
                else:
                    runs = [weak_run(rng, 64, n), weak_run(rng, 128, n)]
                counts[tracks_topk(collapse_runs(runs))["tracks"]] += 1
            print(
                f"| {n} | {name} | {counts[True] / reps:.3f} | {counts[False] / reps:.3f} | {counts[None] / reps:.3f} |",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=1000)
    p.add_argument("--sizes", default="6,18,36", help="cases per length in the ranking table (x 2 lengths)")
    p.add_argument("--collapse-sizes", default="6,12,24,48")
    args = p.parse_args()
    print(
        f"# {platform.node()} {platform.machine()} python {platform.python_version()} {time.strftime('%Y-%m-%d')}"
    )
    t0 = time.time()
    ranking_table(args.reps, [int(x) for x in args.sizes.split(",")])
    print()
    collapse_table(args.reps, [int(x) for x in args.collapse_sizes.split(",")])
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
