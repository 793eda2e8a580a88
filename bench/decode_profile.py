"""One paged decode logits cell, run a few times, for a profiler to read (no timing here).

    ncu --clock-control none -k regex:_paged --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 bench/decode_profile.py --batch 32 --context 131072 --loop persistent

The inputs are ``indexer_bench.decode_case``'s (random queries, weights and keys, scattered
pages), so a profile describes the same cell as the benchmark's tables. ``--loop``: the
persistent loop (the default decode logits) or the program-per-pages one; ``--stages`` and
``--programs-per-sm`` as ``triton_logits.paged_logits`` takes them.
"""

from __future__ import annotations

import argparse

import torch
from indexer_bench import decode_case

from needlescope.kernels import triton_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072, help="tokens (entries = context / 4)")
    ap.add_argument("--key-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"])
    ap.add_argument("--loop", default="persistent", choices=["persistent", "pages"])
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--programs-per-sm", type=int, default=None)
    ap.add_argument("--calls", type=int, default=5, help="launches (a profiler skips the first few)")
    args = ap.parse_args()
    c = decode_case(args.batch, args.context, args.key_dtype, seed=args.batch * 7 + args.context)
    out = torch.empty(args.batch, c["paged"].width, device="cuda")
    for _ in range(args.calls):
        triton_logits.paged_logits(
            c["q"],
            c["w"],
            c["paged"],
            c["lens"],
            out=out,
            persistent=args.loop == "persistent",
            num_stages=args.stages,
            programs_per_sm=args.programs_per_sm,
        )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
