"""Session 12: does Triton's do_bench_cudagraph run fn before the caller's queued work? RAW=1: Triton's
function as is; else bench's med (which synchronizes first). Same steps as the test."""

import os
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, "bench")
import indexer_bench as B  # noqa: E402

RAW = os.environ.get("RAW") == "1"


def timed(fn):
    return do_bench_cudagraph(fn, rep=100, return_mode="median") if RAW else B.med(fn, graph=True)


def trial(alloc: bool, warm: bool) -> bool:
    x = torch.zeros(1, device="cuda")
    low = torch.ones(1, device="cuda")
    if warm:
        timed(lambda: torch.minimum(low, low, out=low))
    torch.cuda._sleep(50_000_000)
    x.fill_(1.0)
    if alloc:
        timed(lambda: low.copy_(torch.minimum(low, x)))
    else:
        timed(lambda: torch.minimum(low, x, out=low))
    return low.item() == 0.0  # fn ran before the fill


for alloc in (False, True):
    for warm in (False, True):
        print(f"raw={RAW} alloc={alloc} warm={warm}: fn ran before the caller's fill:", trial(alloc, warm))
