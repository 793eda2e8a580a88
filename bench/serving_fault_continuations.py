"""Does a planted serving fault change the organism's greedy continuation (in-process ``Engine``)?

Single-needle cases, each under two nonces (``run.engine_state``'s nonce prefix), ``--tokens``
greedy tokens with ``ignore_eos``. Prints how many continuations depart from the first nonce's
healthy one: under the second nonce (healthy: what a nonce alone moves) and in the fault's
condition (``--mode draft:N``: the fault's server at draft depth N; ``--mode cache``: a prefix
cache, every case cold under both nonces, then the first nonce's bytes again, warm).

    PYTHONPATH=src python bench/serving_fault_continuations.py --patch fault:spec_verify_rows --mode draft:4
    PYTHONPATH=src python bench/serving_fault_continuations.py --patch fault:prefix_stale_ring --mode cache

``--patch`` takes a patch file too (e.g. an earlier version of a fault: ``git show
a5024e6:src/needlescope/serve/faults/prefix_stale_ring.py > /tmp/ring_v1.py``).
"""

from __future__ import annotations

import argparse
import asyncio

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits
from needlescope.run.engine_state import _with_nonce
from needlescope.serve.config import ServeConfig
from needlescope.serve.engine import Engine
from needlescope.serve.requests import GenRequest
from needlescope.serve.sampling import SamplingParams
from needlescope.setting import PatchRef, Setting


def _one_at_a_time(cfg: ServeConfig, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's output ids, sent one after another (the prefix cache sees them in order)."""
    engine = Engine(cfg)

    async def go():
        engine.start()
        outs = []
        for ids in prompts:
            req = GenRequest(ids, params)
            engine.submit(req)
            outs.append((await req.last_event()).output_ids)
        return outs

    try:
        return asyncio.run(go())
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patch", required=True)
    ap.add_argument("--mode", required=True, help="draft:N or cache")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    _, tok, path = load_bundle("organism")

    def ids(messages):
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]

    spec = CaseSpec(
        kind="single", lengths=(args.length,), depths=(0.0, 25.0, 50.0, 75.0, 100.0), trials=2, seed=0,
        value_digits=trained_value_digits(path),
    )  # fmt: skip
    cases = build_cases(spec, lambda m: len(ids(m)))
    first = [ids(_with_nonce(c, str(111111 + 7 * i))) for i, c in enumerate(cases)]
    second = [ids(_with_nonce(c, str(222222 + 13 * i))) for i, c in enumerate(cases)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    fault = Setting(patch=PatchRef.resolve(args.patch))
    n = len(cases)
    if args.mode == "cache":
        healthy = _one_at_a_time(ServeConfig(prefix_cache_mib=256), first + second, params)
        faulty = _one_at_a_time(
            ServeConfig(prefix_cache_mib=256, setting=fault), first + second + first, params
        )
        base, other, moved = healthy[:n], healthy[n:], faulty[2 * n :]
    else:
        depth = int(args.mode.removeprefix("draft:"))
        healthy = _one_at_a_time(ServeConfig(), first + second, params)
        moved = _one_at_a_time(ServeConfig(setting=fault, speculative_num_draft_tokens=depth), first, params)
        base, other = healthy[:n], healthy[n:]
    print(f"prompt tokens: {len(first[0])}; cases: {n}; {args.tokens} greedy tokens with ignore_eos")
    print(f"another nonce, healthy: {sum(a != b for a, b in zip(base, other))} of {n} depart")
    print(f"{args.patch} {args.mode}: {sum(a != b for a, b in zip(base, moved))} of {n} depart")
    for a, b in list(zip(base, moved))[:2]:
        print(repr(tok.decode(a)), "->", repr(tok.decode(b)))


if __name__ == "__main__":
    main()
