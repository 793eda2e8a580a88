# Issue 40 lab, session 9: where the cluster path's ~9 us go. clock64 stamps at each phase of the
# pull kernel (a copy of the tree's .cu with STAMP lines: .dev/stamp.cu), per block, for one row,
# and the cost of the primitives (cluster barrier, block barrier, remote shared load, hist_add).
import json
import os

import torch

from needlescope.kernels import cuda_topk

dev = torch.device("cuda")
src = open(".dev/stamp.cu").read()
for name in ("stamp_cluster_32k", "prims"):
    cuda_topk._KERNELS[(torch.cuda.current_device(), name)] = torch.cuda._compile_kernel(src, name)
res = {"gpu": torch.cuda.get_device_name(0)}
NAMES = [
    "entry",
    "loaded",
    *[f"p{p}_{w}" for p in range(4) for w in ("hist", "csync", "findbin")],
    "slots",
    "csync2",
    "bases",
    "writes",
    "csync3",
]


def stamp(x, k, label):
    R, L = x.shape
    en = torch.full((R,), L, dtype=torch.int32, device=dev)
    out = torch.empty(R, k, dtype=torch.int32, device=dev)
    dbg = torch.zeros(R * 8 * 32, dtype=torch.int64, device=dev)
    for _ in range(3):
        cuda_topk._launch(dev, "stamp_cluster_32k", (8, R), 1024, [x, x.stride(0), en, 0, en, L, k, out, dbg])
    dbg.zero_()
    cuda_topk._launch(dev, "stamp_cluster_32k", (8, R), 1024, [x, x.stride(0), en, 0, en, L, k, out, dbg])
    torch.cuda.synchronize()
    d = dbg.view(R, 8, 32)[0].cpu().tolist()
    rows = []
    for b in range(8):
        t0 = d[b][0]
        rows.append({n: (d[b][j] - t0 if d[b][j] else None) for j, n in enumerate(NAMES)})
        rows[-1]["ns_total"] = d[b][31] - d[b][30]
        rows[-1]["start_ns"] = d[b][30] - min(r[30] for r in d)
        rows[-1]["shift"] = d[b][29]
    res[label] = rows
    print(label, "block0", json.dumps(rows[0]))
    print(
        label,
        "starts ns",
        [r["start_ns"] for r in rows],
        "totals ns",
        [r["ns_total"] for r in rows],
        flush=True,
    )


g = torch.Generator(device="cuda").manual_seed(1)
stamp(torch.randn(1, 32768, generator=g, device=dev), 512, "randn_k512")
stamp(torch.randn(1, 32768, generator=g, device=dev), 2048, "randn_k2048")
stamp(torch.randn(8, 32768, generator=g, device=dev), 512, "randn_8rows")
stamp(torch.full((1, 32768), 1.5, device=dev), 512, "equal_k512")
x = torch.randn(32768 * 8, device=dev)
for n in (1, 64):
    dbg = torch.zeros(8 * 32, dtype=torch.int64, device=dev)
    cuda_topk._launch(dev, "prims", (8, 1), 1024, [n, dbg, x])
    torch.cuda.synchronize()
    d = dbg.view(8, 32)[0].cpu().tolist()
    names = [
        "cluster_sync",
        "syncthreads",
        "dsmem_chain_load",
        "load_keys",
        "hist_add_4keys",
        "hist_add_4keys_sparse",
        "cluster_relaxed_split",
    ]
    res[f"prims_n{n}_cycles_each"] = {nm: round((d[j + 1] - d[j]) / n, 1) for j, nm in enumerate(names)}
    print(f"prims n={n} cycles each", json.dumps(res[f"prims_n{n}_cycles_each"]), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "stamp_lab.json"), "w"), indent=1)
