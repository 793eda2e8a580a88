"""Recall of ``needlescope serve`` engine variants on multiturn cases, in-process (no HTTP).

The screen behind the in-process numbers of docs/faults.md: the same 15 seeded multiturn cases
(one length, depths 25/50/75, 5 trials) sent to one ``Engine`` per variant, ``conc`` at a time,
greedy, 16 tokens; a variant is a JSON object of ``ServeConfig`` fields plus ``fault`` (a
built-in fault name), ``num`` (``Setting`` numerics), ``conc`` and ``passes`` (send the cases
that many times: 2 makes the second pass warm in the prefix cache; the last pass is scored).
Prints ``variant (correct, n, [errors])`` per variant. Quicker than ``bench/serving_faults.py``
(no server start, no probe) where a loaded box times the probe's requests out.

    PYTHONPATH=src python bench/serve_recall_inprocess.py 1024 multiturn \\
        '{"fault": "spec_verify_rows", "speculative_num_draft_tokens": 8}' '{"speculative_num_draft_tokens": 8}'
"""

import asyncio
import json
import sys
import time

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.cases.scoring import score_answer
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits
from needlescope.serve.config import ServeConfig
from needlescope.serve.engine import Engine
from needlescope.serve.requests import GenRequest
from needlescope.serve.sampling import SamplingParams
from needlescope.setting import PatchRef, Setting


def main() -> None:
    _, tok, path = load_bundle("organism")

    def ids(messages):
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]

    length, kind = int(sys.argv[1]), sys.argv[2]
    spec = CaseSpec(
        kind=kind, lengths=(length,), depths=(25.0, 50.0, 75.0), trials=5, seed=0,
        value_digits=trained_value_digits(path),
    )  # fmt: skip
    cases = build_cases(spec, lambda m: len(ids(m)))
    prompts = [ids(c.messages) for c in cases]

    def run(cfg: ServeConfig, conc: int, passes: int):
        engine = Engine(cfg)

        async def one(p, gate):
            async with gate:
                req = GenRequest(p, SamplingParams(max_new_tokens=16, temperature=0.0))
                engine.submit(req)
                return await req.last_event()

        async def go():
            engine.start()
            gate = asyncio.Semaphore(conc)
            for _ in range(passes):
                out = await asyncio.gather(*(one(p, gate) for p in prompts))
            return out

        try:
            out = asyncio.run(go())
        finally:
            engine.close()
        answered = [(f, c) for f, c in zip(out, cases) if hasattr(f, "output_ids")]
        errors = [str(f) for f in out if not hasattr(f, "output_ids")]
        hits = sum(
            bool(score_answer(tok.decode(f.output_ids, skip_special_tokens=True), c.expected))
            for f, c in answered
        )
        return hits, len(cases), errors[:2]

    for arg in sys.argv[3:]:
        variant = json.loads(arg)
        conc, passes = variant.pop("conc", 8), variant.pop("passes", 1)
        fault, numerics = variant.pop("fault", None), variant.pop("num", {})
        patch = PatchRef.resolve(f"fault:{fault}") if fault else None
        setting = Setting(**numerics, patch=patch) if (fault or numerics) else None
        start = time.time()
        print(
            arg,
            run(ServeConfig(setting=setting, **variant), conc, passes),
            f"{time.time() - start:.0f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
