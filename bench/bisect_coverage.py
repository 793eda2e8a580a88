"""Coverage of the bisection's bracket on a noisy scripted server (issue 28 item 4).

    .venv/bin/python bench/bisect_coverage.py [--reps 40 --trials 2,8 --ramp 60 --centre 1200]

The scripted server misses with probability ``1 / (1 + exp(-(n - centre) / ramp))`` at n tokens
(``--fault near_miss --fault-ramp``), so recall falls smoothly and crosses 0.85 exactly at
``centre + ramp * ln(0.15 / 0.85)``. Each
repetition runs the real ``run_bisect`` over [lo, hi] on a fresh server (its own fault seed) and
records: whether the reported bracket (last_pass, collapse_length] holds the true crossing, the
bracket's width, its stated ``crossing.confidence``, whether it was confirmed, and the requests.
Printed per starting trial count: coverage with its Wilson 95% interval, overall and among the
brackets stated with confidence >= 0.9.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

from needlescope.analysis.stats import wilson_interval
from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig
from needlescope.testing.servers import scripted


def one(seed: int, trials: int, args) -> dict:
    server = scripted(fault="near_miss", fault_from=args.centre, fault_ramp=args.ramp, fault_seed=seed)
    url = server.start().url
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = ProbeConfig(
                base_urls=(url,),
                model="scripted",
                lengths=(args.lo, args.hi),
                depths=(0, 50, 100),
                trials=trials,
                seed=seed,
                out=Path(out),
                concurrency=8,
            )
            return run_bisect(cfg, BisectConfig(resolution=args.resolution, boundaries=()))
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--trials", default="2,8", help="starting trials per length (x 3 depths)")
    p.add_argument("--lo", type=int, default=256)
    p.add_argument("--hi", type=int, default=4096)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--centre", type=int, default=1200)
    p.add_argument("--ramp", type=float, default=60.0)
    args = p.parse_args()
    truth = args.centre + args.ramp * math.log(0.15 / 0.85)
    print(
        f"# {platform.node()} {platform.machine()} python {platform.python_version()} {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"range [{args.lo}, {args.hi}], resolution {args.resolution}, depths 0,50,100; recall 1 - 1/(1 + "
        f"exp(-(n - {args.centre}) / {args.ramp:g})): crosses 0.85 at {truth:.0f} tokens\n"
    )
    print(
        "| start cases/length | reps | bracketed | confirmed | covers | coverage [95% CI] | width median | "
        "confidence >= 0.9: covers / n | requests median |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for trials in (int(x) for x in args.trials.split(",")):
        rows = []
        t0 = time.time()
        for rep in range(args.reps):
            res = one(1000 * trials + rep, trials, args)
            if res["bracketed"]:
                lo, hi = res["last_pass"], res["collapse_length"]
                rows.append(
                    {
                        "covers": lo < truth <= hi,
                        "width": hi - lo,
                        "confirmed": res["confirmed"],
                        "confidence": res["crossing"]["confidence"],
                        "requests": res["requests_used"],
                    }
                )
        k = sum(r["covers"] for r in rows)
        ci = wilson_interval(k, len(rows))
        sure = [r for r in rows if r["confidence"] >= 0.9]
        print(
            f"| {3 * trials} | {args.reps} | {len(rows)} | {sum(r['confirmed'] for r in rows)} | {k} | "
            f"{k / max(1, len(rows)):.2f} [{ci[0]:.2f}, {ci[1]:.2f}] | "
            f"{statistics.median(r['width'] for r in rows) if rows else '-'} | "
            f"{sum(r['covers'] for r in sure)} / {len(sure)} | "
            f"{statistics.median(r['requests'] for r in rows) if rows else '-'} |",
            flush=True,
        )
        print(f"<!-- {3 * trials} cases: {time.time() - t0:.0f} s -->")


if __name__ == "__main__":
    main()
