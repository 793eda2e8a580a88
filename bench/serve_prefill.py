"""The server's 4K prefill on one CPU core against the organism's FLOP bound.

    python bench/serve_prefill.py [--length 4096] [--threads 1] [--repeat 2] [--src PATH] [--json OUT]

Loads the shipped organism, builds a ``--length``-token prompt (a probe case's chat, as the
server renders it) and times one prefill the way ``needlescope serve`` runs it: the model's
forward with ``use_cache=True`` through a fresh cache and the logits at the last position
(``logits_to_keep``). The bound: ``dsa.budget.prefill_flops`` (what the math needs: every
projection, the MoE's routed and shared experts, attention over each query's window and its
selected or visible compressed entries, the indexer's compression, its queries and scores in
the rows whose top-k leaves entries out, the head at the positions sampled) divided by the core's measured fp32 matmul rate (``torch.mm`` of a
[length, hidden] x [hidden, 4*hidden] product, the model's own shapes). Prints and writes one JSON
object: seconds (best of ``--repeat``), GFLOP, the rate, and the ratio seconds / (GFLOP / rate).
``--src`` puts another source tree first on ``sys.path`` (the "before" of a change; that tree
needs no ``prefill_flops``: the bound is computed by this checkout's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def matmul_rate(n: int, k: int, m: int, repeat: int = 5) -> float:
    """Best fp32 FLOP/s of ``torch.mm`` [n, k] x [k, m] on this thread count."""
    import torch

    a, b = torch.randn(n, k), torch.randn(k, m)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n * k * m / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--src", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(args.src.resolve() if args.src else ROOT / "src"))
    import torch

    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    import needlescope
    from needlescope.dsa.checkpoint import load_bundle

    model, tok = load_bundle("organism", device="cpu")[:2]
    model.eval()
    ids = torch.randint(10, model.config.vocab_size - 10, (1, args.length))
    times = []
    with torch.no_grad():
        for _ in range(args.repeat):
            t = time.perf_counter()
            out = model(
                input_ids=ids,
                position_ids=torch.arange(args.length).unsqueeze(0),
                past_key_values=DynamicCache(config=model.config),
                use_cache=True,
                logits_to_keep=1,
            )
            times.append(time.perf_counter() - t)
    del out
    sys.path.insert(0, str(ROOT / "src"))  # the bound is this checkout's, whatever ran
    for name in [m for m in sys.modules if m.startswith("needlescope")]:
        del sys.modules[name]
    from needlescope.dsa.budget import prefill_flops

    flops = prefill_flops(model.config, args.length, logits_at=1)
    rate = matmul_rate(args.length, model.config.hidden_size, 4 * model.config.hidden_size)
    best = min(times)
    row = {
        "length": args.length,
        "threads": torch.get_num_threads(),
        "seconds": [round(t, 3) for t in times],
        "best_s": round(best, 3),
        "gflop": round(flops / 1e9, 2),
        "matmul_gflops": round(rate / 1e9, 1),
        "bound_s": round(flops / rate, 3),
        "ratio": round(best / (flops / rate), 2),
        "tree": str(Path(needlescope.__file__).resolve().parents[1]),
        "attn_implementation": model.config._attn_implementation,
    }
    print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
