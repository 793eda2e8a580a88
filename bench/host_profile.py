"""Where the host time of an eager decode call goes: per-call host microseconds of the decode
logits and of the default decode path, of their parts, and of a few calibration operations,
then cProfile's functions by own time.

    python3 bench/host_profile.py --batch 32 --context 131072 [--calls 400]

Host time is the time a call takes to return having queued its GPU work (no synchronization in
the timed loop; the GPU queue absorbs the launches). The calibration lines (a Python call, a
tensor view, a CUDA allocation, an empty kernel launch through Triton) tell a slow host from a
slow path. Numbers go to docs/perf/indexer.md with the machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from functools import partial

import torch
import triton
from indexer_bench import decode_case, host_time, jit_launch

from needlescope.kernels import launch, triton_decode, triton_logits


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def profile(fn, calls: int, top: int = 25) -> str:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 100 == 99:
            torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    c = decode_case(args.batch, args.context, "fp8_e4m3", seed=1)
    qa = (c["q"], c["w"], c["paged"], c["lens"])
    out = torch.empty(args.batch, c["paged"].width, device="cuda")
    x = torch.empty(16, device="cuda")
    cases = {
        "python call": lambda: None,
        "tensor view": lambda: x.view(torch.int32),
        "torch.empty cuda": lambda: torch.empty(16, device="cuda"),
        "tensor.to same dtype": lambda: c["lens"].to(torch.int32),
        "empty kernel, JIT launch": lambda: _empty_kernel[(1,)](x, 16),
        "empty kernel, launch()": lambda: launch.launch(_empty_kernel, (1,), x, 16),
        "paged_logits persistent": partial(triton_logits.paged_logits, *qa, out=out),
        "paged_logits persistent, JIT launch": lambda: jit_launch(
            partial(triton_logits.paged_logits, *qa, out=out)
        ),
        "decode_topk default": partial(triton_decode.decode_topk, *qa, 512),
        "decode_topk default, JIT launch": lambda: jit_launch(partial(triton_decode.decode_topk, *qa, 512)),
    }
    for name, fn in cases.items():
        print(f"{name:40s} {host_time(fn, args.calls):8.2f} us/call", flush=True)
    for name in ("paged_logits persistent", "decode_topk default"):
        print(f"\n## cProfile: {name}, {args.calls} calls\n")
        print(profile(cases[name], args.calls), flush=True)


if __name__ == "__main__":
    main()
