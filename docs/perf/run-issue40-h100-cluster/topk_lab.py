# Run 27's lab script, as it ran (2026-12-07 04:22-04:26 UTC, H100), kept with its output. It ran
# against the tree of commit 7b33bca's parent plus that commit's kernel work in progress, whose
# cluster kernels were then named needlescope_topk_cluster_32k (512 x 8), _32k_t1024 (1024 x 4),
# _32k_t256 (256 x 16) and _64k (512 x 16); the tree keeps 1024 x 4 (now named _32k) and 512 x 16.
# Called with PYTHONPATH=src:tests, OUT=/tmp/lab LAB_PART=checks, then LAB_PART=times (run27.sh).
# Issue 40 lab: the cluster top-k variants. LAB_PART=checks: exactness (contract order on random
# rows with ties/starts/short rows; the conformance suite at small and full shapes through the
# cluster path). LAB_PART=times: graph-replayed times (4 input sets) beside the block kernel,
# radix, filter and torch.topk, launch floors and eager host time. Writes $OUT/lab_<part>.json.
import json
import os
import time

import torch
from triton.testing import do_bench_cudagraph

from needlescope.kernels import cuda_topk
from needlescope.kernels import topk as T
from needlescope.kernels.conform import conform
from needlescope.kernels.topk_impls import OURS
from test_kernels_cuda_topk import _contract_order

dev = torch.device("cuda")
PART = os.environ.get("LAB_PART", "checks")
res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "part": PART}
VARIANTS = {
    "c512x8": ("needlescope_topk_cluster_32k", 512, 32768),
    "c1024x4": ("needlescope_topk_cluster_32k_t1024", 1024, 32768),
    "c256x16": ("needlescope_topk_cluster_32k_t256", 256, 32768),
    "c512x16": ("needlescope_topk_cluster_64k", 512, 65536),
}
for v, (name, _th, _cap) in list(VARIANTS.items()):
    t = time.time()
    try:
        cuda_topk._kernel(dev, name)
        res[f"compile_{v}_s"] = round(time.time() - t, 2)
    except Exception as e:
        res[f"compile_{v}"] = f"{type(e).__name__}: {e}"[:2000]
        print(res[f"compile_{v}"])
        del VARIANTS[v]


def run(v, x, k, st, en, out):
    name, th, cap = VARIANTS[v]
    R, L = x.shape
    cuda_topk._launch(
        dev,
        name,
        (8, R),
        th,
        [x, x.stride(0), st if st is not None else en, int(st is not None), en, L, k, out],
    )
    return out


def checks():
    g = torch.Generator(device="cuda").manual_seed(5)
    out = {}
    for R, W, k in (
        (4, 32768, 512),
        (3, 20000, 2048),
        (5, 900, 600),
        (2, 65536, 512),
        (3, 32768, 30000),
        (2, 40000, 1),
    ):
        x = torch.randn(R, W, generator=g, device="cuda")
        x[0, ::7] = x[0, 5]
        if R > 2:
            x[2] = torch.randint(0, 3, (W,), generator=g, device="cuda").float()
        st = torch.randint(0, W // 4, (R,), generator=g, device="cuda", dtype=torch.int32)
        en = torch.randint(W // 2, W + 1, (R,), generator=g, device="cuda", dtype=torch.int32)
        en[-1] = st[-1] + k // 2
        want, want0 = _contract_order(x, k, st, en), _contract_order(x, k, torch.zeros_like(en), en)
        for v, (_name, _th, cap) in VARIANTS.items():
            if W > cap:
                continue
            try:
                a = torch.equal(
                    run(v, x, k, st, en, torch.full((R, k), -7, dtype=torch.int32, device="cuda")), want
                )
                b = torch.equal(
                    run(v, x, k, None, en, torch.full((R, k), -7, dtype=torch.int32, device="cuda")), want0
                )
                out[f"{v} {R}x{W} k{k}"] = a and b
            except Exception as e:
                out[f"{v} {R}x{W} k{k}"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()
    res["order_checks"] = out
    print(json.dumps(out), flush=True)
    for shapes in ("small", "full"):
        t = time.time()
        try:
            rep = conform([("ours:cuda-cluster", OURS["cuda-cluster"])], shapes=shapes, device="cuda")
            cs = rep["impls"][0]["cases"]
            res[f"conform_{shapes}"] = {
                "cases": len(cs),
                "exact": sum(c["exact"] for c in cs),
                "s": round(time.time() - t, 1),
                "bad": {c["name"]: c["error"] or (c["missed"], c["wrong"]) for c in cs if not c["exact"]},
            }
        except Exception as e:
            res[f"conform_{shapes}"] = {"bad": f"{type(e).__name__}: {e}"[:500]}
        print(shapes, json.dumps(res[f"conform_{shapes}"])[:1500], flush=True)
    ok = all(v is True for v in out.values()) and all(
        not res[f"conform_{s}"]["bad"] for s in ("small", "full")
    )
    print("LAB_OK" if ok else "LAB_NOT_OK")
    if ok:
        open("/tmp/lab_ok", "w").write("1")


def med(fn):
    fn()
    torch.cuda.synchronize()
    return 1000 * do_bench_cudagraph(fn, rep=100, return_mode="median")


def times():
    g = torch.Generator(device="cuda").manual_seed(6)
    for R, L, k in (
        (1, 32768, 512),
        (1, 32768, 2048),
        (4, 32768, 512),
        (8, 32768, 512),
        (32, 32768, 512),
        (64, 32768, 512),
        (1, 65536, 512),
        (8, 65536, 512),
        (32, 65536, 512),
        (64, 65536, 512),
    ):
        xs = [torch.randn(R, L, generator=g, device="cuda") for _ in range(4)]
        en = torch.full((R,), L, dtype=torch.int32, device="cuda")
        zero = torch.zeros(R, dtype=torch.int32, device="cuda")
        out = torch.empty(R, k, dtype=torch.int32, device="cuda")
        want = [T.topk(x, k, None, en, method="radix").long().sort(1).values for x in xs]
        fns = {
            "torch": lambda x: torch.topk(x, k, dim=1, sorted=False).indices,
            "radix": lambda x: T.topk(x, k, None, en, method="radix"),
            "filter": lambda x: T.topk(x, k, None, en, method="filter"),
            "block": lambda x: cuda_topk.cuda_topk(x, k, None, en, out=out, path="block"),
        }
        for v, (_name, _th, cap) in VARIANTS.items():
            if L <= cap:
                fns[v] = lambda x, v=v: run(v, x, k, None, en, out)
        row = {}
        for nm, fn in fns.items():
            try:
                same = nm == "torch" or all(
                    torch.equal(fn(x).long().sort(1).values, w) for x, w in zip(xs, want)
                )
                row[nm] = round(med(lambda fn=fn: [fn(x) for x in xs]) / 4, 2)
                if not same:
                    row[nm + "_WRONG"] = True
            except Exception as e:
                row[nm] = f"{type(e).__name__}: {e}"[:200]
        row["floor_block"] = round(
            med(lambda: [cuda_topk.cuda_topk(x, k, None, zero, out=out, path="block") for x in xs]) / 4, 2
        )
        if "c512x8" in VARIANTS and L <= 32768:
            row["floor_c512x8"] = round(
                med(lambda: [run("c512x8", x, k, None, zero, out) for x in xs]) / 4, 2
            )
        res[f"{R}x{L}k{k}"] = row
        print(f"{R}x{L} k{k}", json.dumps(row), flush=True)
    x = torch.randn(32, 32768, device="cuda")
    en = torch.full((32,), 32768, dtype=torch.int32, device="cuda")
    out = torch.empty(32, 512, dtype=torch.int32, device="cuda")
    for p in ("block", "cluster"):
        cuda_topk.cuda_topk(x, 512, None, en, out=out, path=p)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            cuda_topk.cuda_topk(x, 512, None, en, out=out, path=p)
        res[f"host_us_{p}"] = round((time.perf_counter() - t) / 200 * 1e6, 1)
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        T.topk(x, 512, None, en, method="filter")
    res["host_us_filter"] = round((time.perf_counter() - t) / 200 * 1e6, 1)
    torch.cuda.synchronize()
    print(json.dumps({k: v for k, v in res.items() if k.startswith("host")}))


checks() if PART == "checks" else times()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"lab_{PART}.json"), "w"), indent=1)
