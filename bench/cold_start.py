"""The persistent fp8 decode logits started warm and cold, with scattered and with sequential pages.

    python3 bench/cold_start.py [--cells 32x131072,64x262144]

Times ``paged_logits`` (the default persistent loop) three ways: CUDA-graph replays (warm: the
previous replay touched the same pages), after a 256 MB read of another buffer (cold, clean L2)
and after do_bench's 256 MB memset (cold, ~50 MB of dirty L2 lines), once with the benchmark's
scattered block table (``decode_case``: pages in random pool order) and once with the same keys
in pool order. A cold-start cost that the sequential table does not pay is a cost of the access
order (address translation or DRAM locality), not of the kernel's arithmetic. Prints one JSON
line per cell and a markdown table (docs/perf/indexer.md).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from indexer_bench import decode_bytes, decode_case, med, med_clean_flush

from needlescope.kernels import triton_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="32x131072,64x262144", help="BATCHxCONTEXT, comma-separated")
    args = ap.parse_args()
    n = 1 << 28
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    copy_GBps = 2 * n / med(partial(torch.empty_like(src).copy_, src)) / 1e3
    rows = []
    for cell in args.cells.split(","):
        B, ctx = (int(v) for v in cell.split("x"))
        seed = B * 7 + ctx
        scattered = decode_case(B, ctx, "fp8_e4m3", seed)
        roofline = decode_bytes(scattered, "fp8_e4m3") / copy_GBps / 1e3
        row = {"batch": B, "context": ctx, "copy_GBps": copy_GBps, "roofline_us": roofline}
        outs = {}
        for order, c in (
            ("scattered", scattered),
            ("sequential", decode_case(B, ctx, "fp8_e4m3", seed, sequential=True)),
        ):
            out = torch.empty(B, c["paged"].width, device="cuda")
            fn = partial(triton_logits.paged_logits, c["q"], c["w"], c["paged"], c["lens"], out=out)
            fn()
            outs[order] = out.clone()
            row[f"{order}_graph_us"] = med(fn, graph=True)
            row[f"{order}_clean_us"] = med_clean_flush(fn)
            row[f"{order}_flushed_us"] = med(fn)
        row["logits_equal"] = bool(torch.equal(outs["scattered"], outs["sequential"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| batch | context | roofline µs | pages | graph µs | clean flush µs | memset flush µs |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        for order in ("scattered", "sequential"):
            t = [r[f"{order}_{m}_us"] for m in ("graph", "clean", "flushed")]
            pct = [f"{x:.1f} ({100 * r['roofline_us'] / x:.0f}%)" for x in t]
            print(
                f"| {r['batch']} | {r['context'] // 1024}K | {r['roofline_us']:.1f} | {order} | "
                + " | ".join(pct)
                + " |"
            )


if __name__ == "__main__":
    main()
