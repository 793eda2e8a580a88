"""Session 11: the fused decode path through the CUDA group path at the four goal cells (graph-replayed)."""

import json
import os
import sys
from functools import partial

sys.path.insert(0, "bench")
import indexer_bench as B
import torch

from needlescope.kernels import cuda_topk, topk, triton_decode, triton_logits

out = {}
for bsz, ctx in [(32, 131072), (64, 131072), (32, 262144), (64, 262144)]:
    c = B.decode_case(bsz, ctx, "fp8_e4m3", seed=bsz + ctx)
    args = (c["q"], c["w"], c["paged"], c["lens"])
    k = 512
    logits = triton_logits.paged_logits(*args, persistent=True)
    gmax = torch.empty(bsz, c["paged"].block_table.shape[1] * 4, dtype=torch.int32, device="cuda")
    triton_logits.paged_logits(*args, persistent=True, gmax=gmax)
    want = topk.topk(logits, k, None, c["lens"], method="bisect").sort(1).values
    r = {}
    fns = {
        "logits": partial(triton_logits.paged_logits, *args, out=logits, persistent=True),
        "logits_gmax": partial(triton_logits.paged_logits, *args, out=logits, persistent=True, gmax=gmax),
        "topk_default": partial(topk.topk, logits, k, None, c["lens"]),
        "group_topk": partial(cuda_topk.group_topk, logits, k, c["lens"], gmax),
        "unfused": partial(triton_decode.decode_topk, *args, k, fused=False),
        "fused_cuda": partial(triton_decode.decode_topk, *args, k, fused=True, select="cuda"),
        "fused_filter": partial(triton_decode.decode_topk, *args, k, fused=True, select="filter"),
        "default": partial(triton_decode.decode_topk, *args, k),
    }
    for name, fn in fns.items():
        res = fn()
        if name not in ("logits", "logits_gmax"):
            r[name + "_same"] = bool(torch.equal(res.sort(1).values, want))
        r[name + "_us"] = round(B.med(fn, graph=True), 2)
    r["lead_pct"] = round(100 * (r["unfused_us"] - r["fused_cuda_us"]) / r["unfused_us"], 1)
    out[f"{bsz}x{ctx}"] = r
    print(bsz, ctx, json.dumps(r), flush=True)
# standalone rows
for rows, L in [(1, 32768), (8, 32768), (32, 32768), (64, 32768), (32, 65536), (64, 65536)]:
    x = torch.randn(rows, L, device="cuda")
    ends = torch.full((rows,), L, dtype=torch.int32, device="cuda")
    from needlescope.kernels.topk_impls import given_maxima

    gm = given_maxima(x, ends)
    a = cuda_topk.group_topk(x, 512, ends, gm)
    b = topk.topk(x, 512, None, ends)
    r = {
        "same": bool(torch.equal(a.sort(1).values, b.sort(1).values)),
        "group_us": round(B.med(partial(cuda_topk.group_topk, x, 512, ends, gm), graph=True), 2),
        "default_us": round(B.med(partial(topk.topk, x, 512, None, ends), graph=True), 2),
    }
    out[f"topk{rows}x{L}"] = r
    print(rows, L, json.dumps(r), flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/groups_lab.json", "w"), indent=1)
