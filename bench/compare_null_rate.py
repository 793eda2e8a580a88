"""False-positive rate of the paired A/B verdict when A and B are the same model (scripted server).

    .venv/bin/python bench/compare_null_rate.py [--reps 200 --rate 0.3]

Two scripted servers each miss a fraction ``--rate`` of cases at random, with independent seeds,
so the null hypothesis (same recall) is true and discordant pairs are common. One case set
(2 lengths x 2 depths x 5 trials, the test's size) is re-sent to both per repetition through the
real client and SQLite store; a repetition is a false positive when any bucket's Holm-corrected
McNemar p is below 0.05. Prints the rate with its Wilson 95% interval.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from needlescope.analysis.paired import Pair, compare_pairs
from needlescope.analysis.stats import wilson_interval
from needlescope.cases import CaseSpec, build_cases, score_answer
from needlescope.run import ResultStore, run_cases
from needlescope.targets import ChatTarget, ServerTokenCounter


def _server(rate: float, seed: int) -> tuple[subprocess.Popen, str]:
    args = [
        "--window",
        "100000",
        "--fault",
        "unrelated",
        "--fault-rate",
        str(rate),
        "--fault-seed",
        str(seed),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "needlescope.testing.scripted_server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


async def _side(url: str, cases: list[dict], store: ResultStore) -> None:
    async with ChatTarget(url, "scripted", retries=0) as target:
        await run_cases(
            cases, target, store, concurrency=8, max_tokens=8, extra_body=None, score=score_answer
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rate", type=float, default=0.3)
    args = p.parse_args()
    (pa, a), (pb, b) = _server(args.rate, 1), _server(args.rate, 2)
    try:
        spec = CaseSpec(kind="single", lengths=(100, 200), depths=(0, 100), trials=5, seed=0, value_digits=3)
        cases = [c.to_dict() for c in build_cases(spec, ServerTokenCounter(a, "scripted"))]
        positives = discordant = 0
        with tempfile.TemporaryDirectory() as d:
            for rep in range(args.reps):
                stores = [ResultStore(Path(d) / f"{rep}{s}.sqlite") for s in "ab"]
                for url, store in zip((a, b), stores):
                    asyncio.run(_side(url, cases, store))
                res_a, res_b = ({r["case_id"]: r for r in st.results()} for st in stores)
                pairs = [
                    Pair(
                        c["case_id"],
                        c["length"],
                        c["depth"],
                        bool(res_a[c["case_id"]]["correct"]),
                        bool(res_b[c["case_id"]]["correct"]),
                    )
                    for c in cases
                ]
                result = compare_pairs(pairs, n_boot=200)
                positives += any(bk["p_holm"] < 0.05 for bk in result["buckets"])
                discordant += sum(x.a != x.b for x in pairs)
                for st in stores:
                    st.close()
                if (rep + 1) % 10 == 0:
                    print(f"after {rep + 1} repetitions: {positives} false positive(s)", flush=True)
    finally:
        for proc in (pa, pb):
            proc.kill()
            proc.wait()
    lo, hi = wilson_interval(positives, args.reps)
    print(
        f"repetitions {args.reps}, pairs each {len(cases)}, discordant pairs {discordant / args.reps:.1f} per repetition"
    )
    print(
        f"false positives {positives}/{args.reps} = {positives / args.reps:.3f} (Wilson 95% [{lo:.3f}, {hi:.3f}])"
    )


if __name__ == "__main__":
    main()
