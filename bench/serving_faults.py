"""Recall of the organism under each planted serving fault, by the level of the factor it needs.

For each row: ``needlescope serve --model organism --continuous-batching FLAGS`` (a child process), then
``needlescope probe`` against it (the same seeded cases every row), once or twice (``warm``: a
second pass of the same cases, each continuing the prefix the first one kept); the recall of
the last pass is reported with n. The healthy rows are the same flags without the fault.

    PYTHONPATH=src python bench/serving_faults.py --lengths 1024 --depths 25,50,75 --trials 5 \
        --out /tmp/serving_faults.json

Prints one Markdown table row per setting and writes every number to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from needlescope.serve.launch import ServerProcess

DEPLOY = ["--index-k", "fp8_e4m3", "--index-topk", "64"]
WARM = ["--prefix-cache-mib", "256"]
# A prompt of 1,027 tokens ends 3 tokens past its 1,024-token cache boundary: its last
# positions read the boundary's ring (a 1,024-token one ends 128 past 896, the ring long gone).
RING = ["--lengths", "1027"]
# (fault, factor level shown in the table, server flags, probe flags, passes)
ROWS = [
    (None, "no chunking", [], [], 1),
    ("chunk_carry", "prefill chunk 1024", ["--prefill-chunk", "1024"], [], 1),
    ("chunk_carry", "prefill chunk 512", ["--prefill-chunk", "512"], [], 1),
    ("chunk_carry", "prefill chunk 300", ["--prefill-chunk", "300"], [], 1),
    (None, "draft 8", ["--speculative-num-draft-tokens", "8"], [], 1),
    ("spec_verify_rows", "draft 2", ["--speculative-num-draft-tokens", "2"], [], 1),
    ("spec_verify_rows", "draft 4", ["--speculative-num-draft-tokens", "4"], [], 1),
    ("spec_verify_rows", "draft 8", ["--speculative-num-draft-tokens", "8"], [], 1),
    (None, "fp8 top-64, concurrency 8", DEPLOY, ["--concurrency", "8"], 1),
    ("batch_variant_scores", "fp8 top-64, concurrency 1", DEPLOY, ["--concurrency", "1"], 1),
    ("batch_variant_scores", "fp8 top-64, concurrency 8", DEPLOY, ["--concurrency", "8"], 1),
    (None, "1,027 tokens, prefix cache warm", WARM, RING, 2),
    ("prefix_stale_ring", "1,027 tokens, prefix cache cold", WARM, RING, 1),
    ("prefix_stale_ring", "1,027 tokens, prefix cache warm", WARM, RING, 2),
]


def _probe(url: str, out: str, args, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "needlescope.cli.main", "probe", "--base-url", url + "/v1", "--model", "organism",
        "--kind", args.kind, "--lengths", args.lengths, "--depths", args.depths, "--trials", str(args.trials),
        "--seed", str(args.seed), "--max-tokens", "16", "--bundles", "0", "--out", out, "--force", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    n = sum(c["n"] for c in summary["cells"])
    correct = sum(c["correct"] for c in summary["cells"])
    with open(os.path.join(out, "results.jsonl")) as f:
        cached = sum(json.loads(line).get("cached_tokens") or 0 for line in f)
    return {"n": n, "correct": correct, "recall": correct / n if n else None, "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="multiturn")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--depths", default="25,50,75")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="Faults, levels or 'healthy' to run, separated by ;, default all rows.")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    only = set(args.only.split(";")) if args.only else None
    results = []
    for fault, level, flags, probe_flags, passes in ROWS:
        if only is not None and not ({fault or "healthy", level} & only):
            continue
        serve = ["--model", "organism", "--port", "0", "--continuous-batching", *flags]
        if fault:
            serve += ["--patch", f"fault:{fault}"]
        start = time.time()
        server = ServerProcess(serve, timeout=600).start()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for i in range(passes):
                    got = _probe(server.url, os.path.join(tmp, f"p{i}"), args, probe_flags)
        finally:
            server.stop()
        row = {
            "fault": fault,
            "level": level,
            "flags": flags + probe_flags,
            **got,
            "wall_s": time.time() - start,
        }
        results.append(row)
        print(
            f"| {fault or 'none'} | {level} | {got['correct']}/{got['n']} = {got['recall']:.2f} | "
            f"{got['cached_tokens']} | {row['wall_s']:.0f} s |",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
