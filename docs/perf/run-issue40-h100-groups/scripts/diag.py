"""Session 11, call 4: run 34's two odd cells (seeds 131136 and 262208) with every step synchronized."""

import sys
import traceback

sys.path.insert(0, "bench")
sys.path.insert(0, "tests")
import indexer_bench as B
import torch

from needlescope.kernels import cuda_topk, topk, triton_decode, triton_logits
from needlescope.kernels.reference import paged_logits_reference
from needlescope.kernels.topk_impls import given_maxima


def step(name, fn):
    try:
        r = fn()
        torch.cuda.synchronize()
        return r
    except Exception:
        print("FAILED at", name)
        traceback.print_exc(limit=4)
        raise SystemExit(1) from None


for bsz, ctx, seed in [(64, 131072, 131136), (64, 262144, 262208), (64, 131072, 64 * 7 + 131072)]:
    print("cell", bsz, ctx, seed, flush=True)
    c = step("decode_case", lambda: B.decode_case(bsz, ctx, "fp8_e4m3", seed=seed))
    args = (c["q"], c["w"], c["paged"], c["lens"])
    print(
        " q finite",
        bool(torch.isfinite(c["q"].float()).all()),
        "w finite",
        bool(torch.isfinite(c["w"]).all()),
        "key codes finite",
        bool(torch.isfinite(c["keys"].codes.float()).all()),
        "scales finite",
        bool(torch.isfinite(c["keys"].scales).all()),
        flush=True,
    )
    lg = step("logits", lambda: triton_logits.paged_logits(*args, persistent=True))
    nan = torch.isnan(lg).sum(1)
    inf = torch.isinf(lg).sum(1)
    print(
        " rows with NaN:",
        int((nan > 0).sum()),
        "max NaN a row:",
        int(nan.max()),
        "rows with inf:",
        int((inf > 0).sum()),
        flush=True,
    )
    ref = step("reference", lambda: paged_logits_reference(*args))
    fin = torch.isfinite(ref) & torch.isfinite(lg)
    print(
        " |logits - reference| max",
        float((lg - ref)[fin].abs().max()),
        "ref NaN rows",
        int(torch.isnan(ref).any(1).sum()),
        flush=True,
    )
    del ref
    u = torch.unique(lg, dim=None)
    print(" distinct values in the batch", u.numel(), "of", lg.numel(), flush=True)
    for r in range(0, bsz, 8):
        print(
            "  row",
            r,
            "distinct",
            torch.unique(lg[r]).numel(),
            "min/max",
            float(lg[r].min()),
            float(lg[r].max()),
            flush=True,
        )
    gm = step("maxima", lambda: given_maxima(lg, c["lens"]))
    a = step("group", lambda: cuda_topk.group_topk(lg, 512, c["lens"], gm))
    b = step("block", lambda: topk.topk(lg, 512, None, c["lens"]))
    print(" group == default (sets):", bool(torch.equal(a.sort(1).values, b.sort(1).values)), flush=True)
    print(
        " times group / default / fused:",
        round(B.med(lambda: cuda_topk.group_topk(lg, 512, c["lens"], gm), graph=True), 2),
        round(B.med(lambda: topk.topk(lg, 512, None, c["lens"]), graph=True), 2),
        round(B.med(lambda: triton_decode.decode_topk(*args, 512, fused=True, select="cuda"), graph=True), 2),
        flush=True,
    )
