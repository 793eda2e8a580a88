"""Time synthetic top-k survival (``needlescope.dsa.synthetic``) at real indexer dimensions.

    .venv/bin/python bench/synthetic_topk.py [--device cpu|cuda] [--entries 4096,16384] [--trials 4]

Defaults: CPU, 4096 and 16384 entries; with ``--device cuda`` (default when CUDA is available)
65536 and 262144 entries. 64 heads x 128 dims, top-512, margins 0 and 0.001 of the score spread
over the k-th distractor, precisions fp32, bf16, fp8_e4m3, fp4_e2m1. Prints one JSON line per
entry count: seconds per trial (all precisions), entries scored per second, and the kept rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import torch

from needlescope.dsa.synthetic import SyntheticConfig, parse_precisions, run_synthetic


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--entries", default=None, help="comma-separated entry counts")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--precisions", default="fp32,bf16,fp8_e4m3,fp4_e2m1")
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    entries = [int(x) for x in (args.entries or ("65536,262144" if on_gpu else "4096,16384")).split(",")]
    chunk = args.chunk or (65536 if on_gpu else 16384)
    precisions = parse_precisions(args.precisions)
    margins = (0.0, 0.001)
    for n in entries:
        cfg = SyntheticConfig(
            entries=(n,),
            heads=args.heads,
            dim=128,
            topk=512,
            margins=margins,
            margin_unit="spread",
            margin_ref="kth",
            trials=args.trials,
            precisions=precisions,
            chunk=chunk,
            device=args.device,
        )
        run_synthetic(dataclasses.replace(cfg, trials=1))  # warm-up (allocator, kernels)
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        obj = run_synthetic(cfg)
        if on_gpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n_trials = args.trials * len(margins)
        # Each trial scores L entries once for the planting statistics and once per precision.
        scored = n * n_trials * (1 + len(precisions))
        print(
            json.dumps(
                {
                    "bench": "synthetic_topk",
                    "device": args.device,
                    "device_name": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
                    "torch": torch.__version__,
                    "entries": n,
                    "heads": args.heads,
                    "dim": 128,
                    "topk": 512,
                    "trials": n_trials,
                    "precisions": len(precisions),
                    "seconds": round(dt, 3),
                    "seconds_per_trial": round(dt / n_trials, 4),
                    "entries_scored_per_s": round(scored / dt),
                    "kept_rate": {
                        f"{r['index_k']}@{r['margin']}": round(r["kept_rate"], 3) for r in obj["results"]
                    },
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
