"""How often ``fault:spec_verify_rows`` corrupts an answer, by draft depth (in-process engine).

The organism's needle answers are 3 digits: they end inside one verify step, before a
corrupted compressor state is read, so recall does not show this fault. Long copies do: each
multiturn case is answered with ``--tokens`` greedy tokens (``ignore_eos``: the organism goes on
copying its training phrasing, which prompt lookup drafts well), by a healthy engine at draft
depth 0 and by the faulty one at each depth; an answer is corrupted when its tokens differ from
the healthy one's. Reports the corrupted count, n, and the 95% upper bound (exact binomial).

    PYTHONPATH=src python bench/spec_fault_corruption.py --cases 16 --drafts 2,3,4,6,8 --out /tmp/spec_fault.json
"""

from __future__ import annotations

import argparse
import asyncio
import json

from scipy.stats import beta

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits
from needlescope.serve.config import ServeConfig
from needlescope.serve.engine import Engine
from needlescope.serve.requests import GenRequest
from needlescope.serve.sampling import SamplingParams
from needlescope.setting import PatchRef, Setting


def _answers(
    cfg: ServeConfig, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list]:
    engine = Engine(cfg)

    async def one(ids):
        req = GenRequest(ids, params)
        engine.submit(req)
        return await req.last_event()

    async def go():
        engine.start()
        return await asyncio.gather(*(one(ids) for ids in prompts))

    try:
        finals = asyncio.run(go())
    finally:
        engine.close()
    return [f.output_ids for f in finals], finals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--drafts", default="2,3,4,6,8")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _, tok, path = load_bundle("organism")

    def ids(messages):
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]

    depths = (10.0, 30.0, 50.0, 70.0, 90.0)
    spec = CaseSpec(
        kind="multiturn", lengths=(args.length,), depths=depths, trials=-(-args.cases // len(depths)), seed=0,
        value_digits=trained_value_digits(path),
    )  # fmt: skip
    prompts = [ids(c.messages) for c in build_cases(spec, lambda m: len(ids(m)))][: args.cases]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    healthy, _ = _answers(ServeConfig(), prompts, params)
    fault = Setting(patch=PatchRef.resolve("fault:spec_verify_rows"))
    rows = []
    print("| draft tokens | corrupted / n | 95% upper bound | acceptance |")
    for n in (int(x) for x in args.drafts.split(",")):
        got, finals = _answers(ServeConfig(setting=fault, speculative_num_draft_tokens=n), prompts, params)
        bad = sum(a != b for a, b in zip(healthy, got))
        upper = 1.0 if bad == len(got) else float(beta.ppf(0.975, bad + 1, len(got) - bad))
        proposed = sum(f.speculative.proposed for f in finals)
        rate = sum(f.speculative.accepted for f in finals) / proposed if proposed else None
        rows.append(
            {"draft_tokens": n, "corrupted": bad, "n": len(got), "upper95": upper, "acceptance": rate}
        )
        print(f"| {n} | {bad}/{len(got)} | {upper:.2f} | {rate:.2f} |", flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
