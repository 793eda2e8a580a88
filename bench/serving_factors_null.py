"""False positives of ``needlescope serving-factors``: how many of N repeated experiments against
a healthy server name a factor (docs/serving_factors.md records the counts).

    python bench/serving_factors_null.py --runs 20                       # a scripted server, 10% random misses
    python bench/serving_factors_null.py --runs 20 --trials 40 --noise 0.3 --min-loss 0.3  # 120 cases
    python bench/serving_factors_null.py --runs 20 --base-url URL --model organism --lengths 256 --trials 2

Each run draws fresh nonces and a new case seed (run i: seed i), so no two runs send the same
prompts. A run counts as naming a factor when its recall verdict or its output-identity verdict
(``--continuation N``: N greedy tokens with ``ignore_eos`` per send) names one. Prints one line
per run and the count.
"""

from __future__ import annotations

import argparse
import contextlib
import time

from needlescope.run.serving_factors import FactorConfig, run_serving_factors
from needlescope.testing.servers import scripted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--base-url", default=None, help="default: a scripted server with --fault-rate 0.1")
    p.add_argument("--model", default="scripted")
    p.add_argument("--lengths", default="120")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--factors", default="cache,batch,repeat")
    p.add_argument("--batch-mates", default="1")
    p.add_argument("--depths", default="0,50,100")
    p.add_argument("--draft-depths", default="", help="per-request draft depths (a draft factor), e.g. 2,8")
    p.add_argument("--min-loss", type=float, default=0.1)
    p.add_argument("--no-interactions", action="store_true", help="single-factor arms only (fewer tests)")
    p.add_argument("--continuation", type=int, default=0, help="greedy tokens per send (ignore_eos)")
    p.add_argument("--noise", type=float, default=0.1, help="the scripted server's random miss rate")
    a = p.parse_args()
    server = (
        contextlib.nullcontext(None)
        if a.base_url
        else scripted(model="scripted", fault="near_miss", fault_rate=a.noise, fault_seed=7)
    )
    named, t0 = 0, time.monotonic()
    with server as srv:
        url = a.base_url or srv.url
        for run in range(a.runs):
            cfg = FactorConfig(
                (url,),
                a.model,
                factors=tuple(a.factors.split(",")),
                lengths=tuple(int(x) for x in a.lengths.split(",")),
                trials=a.trials,
                depths=tuple(float(x) for x in a.depths.split(",")),
                batch_mates=tuple(int(x) for x in a.batch_mates.split(",")),
                draft_depths=tuple(int(x) for x in a.draft_depths.split(",") if x),
                seed=run,
                min_loss=a.min_loss,
                interactions=not a.no_interactions,
                continuation=a.continuation,
            )
            body = run_serving_factors(cfg)
            verdict, ident = body["verdict"], body["identity"]
            changed = ident is not None and ident["verdict"]["named"] is not None
            named += verdict["named"] is not None or changed
            output = f"; output: {ident['verdict']['sentence']}" if ident is not None else ""
            print(
                f"run {run + 1}: {verdict['sentence']}; min power {verdict['min_power']:.2f}{output}",
                flush=True,
            )
    print(f"{named} of {a.runs} experiments named a factor ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
