"""Throughput of ``needlescope serve`` on a fixed small workload; prints one JSON object.

Against a running server:
    python bench/serve_throughput.py --base-url http://127.0.0.1:8000 --model organism
Or let the bench start one (the real CLI) on a checkpoint, e.g. a random organism:
    python bench/serve_throughput.py --start-model DIR --max-running-requests 8

Workload: ``--requests`` chat completions of ``--prompt-words`` filler words each, ``--max-tokens``
generated tokens each (``ignore_eos``, so every request decodes the same number), sent with
``--concurrency`` in flight. ``--mixed-lengths`` gives every request a different prompt length,
which defeats the engine's equal-length batching (the worst case for it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

WORDS = "the river ran past the old mill and the baker sold bread to every child in the town".split()


def prompt(i: int, n_words: int, mixed: bool) -> str:
    n = n_words + (i if mixed else 0)
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))


async def run(base: str, model: str, args: argparse.Namespace) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    latencies: list[float] = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    statuses: dict[int, int] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt(i, args.prompt_words, args.mixed_lengths)}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with sem:
            t = time.monotonic()
            r = await client.post(base + "/v1/chat/completions", json=body)
            latencies.append(time.monotonic() - t)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code == 200:
            u = r.json()["usage"]
            usage["prompt_tokens"] += u["prompt_tokens"]
            usage["completion_tokens"] += u["completion_tokens"]

    async with httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=args.concurrency + 4)
    ) as client:
        await one(client, -1)  # warm-up, not counted
        latencies.clear()
        usage.update(prompt_tokens=0, completion_tokens=0)
        statuses.clear()
        t0 = time.monotonic()
        await asyncio.gather(*(one(client, i) for i in range(args.requests)))
        wall = time.monotonic() - t0
        info = (await client.get(base + "/get_server_info")).json()
    latencies.sort()
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "prompt_words": args.prompt_words,
        "mixed_lengths": args.mixed_lengths,
        "max_tokens": args.max_tokens,
        "statuses": statuses,
        "wall_s": round(wall, 3),
        "requests_per_s": round(args.requests / wall, 3),
        "generated_tokens_per_s": round(usage["completion_tokens"] / wall, 2),
        "prompt_tokens_per_s": round(usage["prompt_tokens"] / wall, 2),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
        "latency_max_s": round(latencies[-1], 3),
        "server": {
            k: info.get(k) for k in ("model", "max_running_requests", "threads", "device", "batching")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server's root URL")
    ap.add_argument("--model", default="organism", help="served model name (with --base-url)")
    ap.add_argument("--start-model", default=None, help="start `needlescope serve --model DIR` for the run")
    ap.add_argument("--max-running-requests", type=int, default=8, help="with --start-model")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mixed-lengths", action="store_true")
    args = ap.parse_args()
    if (args.base_url is None) == (args.start_model is None):
        ap.error("give exactly one of --base-url and --start-model")
    if args.base_url is not None:
        print(json.dumps(asyncio.run(run(args.base_url.rstrip("/").removesuffix("/v1"), args.model, args))))
        return
    from needlescope.serve.launch import ServerProcess

    serve_args = ["--model", args.start_model, "--port", "0", "--served-model-name", "bench"]
    serve_args += ["--max-running-requests", str(args.max_running_requests)]
    serve_args += ["--max-queued-requests", str(max(64, args.requests))]
    with ServerProcess(serve_args) as srv:
        print(json.dumps(asyncio.run(run(srv.url, "bench", args))))


if __name__ == "__main__":
    main()
