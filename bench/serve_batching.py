"""Engine throughput: continuous vs static batching by concurrency, and speculative decoding by
draft depth, on the shipped organism in-process (the serve engine without HTTP).

Workload: multiturn needle cases of mixed lengths (``--lengths``), so equal-length batches are
small and late requests would wait for a batch in flight; each request asks a random number of
tokens in ``--max-tokens`` with ``ignore_eos`` (its length is fixed whatever the answer, so both
modes do the same work). ``--concurrency`` requests are kept in flight. Speculative decoding:
the same cases one at a time (concurrency 1), greedy, ``--spec-tokens`` new tokens each, at
every draft depth of ``--drafts`` (0 = off).

    PYTHONPATH=src python bench/serve_batching.py --requests 32 --concurrency 1,8,32 --drafts 0,2,4,8 \
        --out /tmp/serve_batching.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits
from needlescope.serve.config import ServeConfig
from needlescope.serve.engine import Engine
from needlescope.serve.requests import GenRequest
from needlescope.serve.sampling import SamplingParams


def _prompts(lengths: tuple[int, ...], n: int, seed: int) -> list[list[int]]:
    _, tok, path = load_bundle("organism")

    def ids(messages):
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]

    depths = (10.0, 30.0, 50.0, 70.0, 90.0)
    trials = -(-n // (len(lengths) * len(depths)))
    spec = CaseSpec(
        kind="multiturn", lengths=lengths, depths=depths, trials=trials, seed=seed,
        value_digits=trained_value_digits(path),
    )  # fmt: skip
    cases = build_cases(spec, lambda m: len(ids(m)))
    random.Random(seed).shuffle(cases)
    return [ids(c.messages) for c in cases[:n]]


def _serve(
    cfg: ServeConfig, prompts: list[list[int]], params: list[SamplingParams], concurrency: int
) -> dict:
    """Run every prompt with ``concurrency`` in flight; wall time, tokens, and the finals."""
    engine = Engine(cfg)

    async def one(ids, p, gate):
        async with gate:
            req = GenRequest(ids, p)
            engine.submit(req)
            return await req.last_event()

    async def go():
        engine.start()
        gate = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        finals = await asyncio.gather(*(one(ids, p, gate) for ids, p in zip(prompts, params)))
        return time.perf_counter() - start, finals

    try:
        wall, finals = asyncio.run(go())
    finally:
        engine.close()
    tokens = sum(f.completion_tokens for f in finals)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "finals": finals}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,320,384,448,512")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", default="8,32", help="min,max answer tokens per request")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--drafts", default="0,2,4,8")
    ap.add_argument("--spec-requests", type=int, default=8)
    ap.add_argument("--spec-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    prompts = _prompts(lengths, args.requests, args.seed)
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    rnd = random.Random(args.seed)
    params = [
        SamplingParams(max_new_tokens=rnd.randint(lo, hi), temperature=0.0, ignore_eos=True) for _ in prompts
    ]
    out: dict = {"args": vars(args), "batching": [], "speculative": []}
    print("| concurrency | static tok/s | continuous tok/s | speed-up | identical |")
    for c in (int(x) for x in args.concurrency.split(",")):
        static = _serve(ServeConfig(continuous_batching=False, max_running_requests=32), prompts, params, c)
        cont = _serve(ServeConfig(max_running_requests=32), prompts, params, c)
        same = all(a.output_ids == b.output_ids for a, b in zip(static["finals"], cont["finals"]))
        row = {
            "concurrency": c,
            "static": {k: v for k, v in static.items() if k != "finals"},
            "continuous": {k: v for k, v in cont.items() if k != "finals"},
            "identical": same,
            "max_running": max(f.batch.max_running for f in cont["finals"]),
            "joined_mid_flight": sum(f.batch.joined_mid_flight for f in cont["finals"]),
        }
        out["batching"].append(row)
        print(
            f"| {c} | {static['tokens_per_s']:.1f} | {cont['tokens_per_s']:.1f} | "
            f"{cont['tokens_per_s'] / static['tokens_per_s']:.2f}x | {same} |",
            flush=True,
        )
    spec_prompts = prompts[: args.spec_requests]
    greedy = [SamplingParams(max_new_tokens=args.spec_tokens, temperature=0.0, ignore_eos=True)] * len(
        spec_prompts
    )
    print("| draft tokens | tok/s | speed-up | acceptance | identical |")
    base = None
    for n in (int(x) for x in args.drafts.split(",")):
        got = _serve(ServeConfig(speculative_num_draft_tokens=n), spec_prompts, greedy, 1)
        base = base or got
        proposed = sum(f.speculative.proposed for f in got["finals"])
        accepted = sum(f.speculative.accepted for f in got["finals"])
        same = all(a.output_ids == b.output_ids for a, b in zip(base["finals"], got["finals"]))
        rate = accepted / proposed if proposed else None
        out["speculative"].append(
            {
                "draft_tokens": n,
                "wall_s": got["wall_s"],
                "tokens": got["tokens"],
                "tokens_per_s": got["tokens_per_s"],
                "proposed": proposed,
                "accepted": accepted,
                "acceptance_rate": rate,
                "identical": same,
            }
        )
        print(
            f"| {n} | {got['tokens_per_s']:.1f} | {got['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{'-' if rate is None else f'{rate:.2f}'} | {same} |",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
