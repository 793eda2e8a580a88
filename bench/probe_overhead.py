"""Client overhead of the probe, and how much of a standard sweep a prefix cache can reuse.

    .venv/bin/python bench/probe_overhead.py [--requests 3000] [--concurrency 64]

1. Requests per second that ChatTarget sustains against a zero-latency loopback server
   (asyncio streams answering a fixed completion), so the server is never the bottleneck being measured.
2. Prompt tokens a standard sweep (4 lengths x 7 depths x 5 trials) sends, and how many tokens a
   server-side prefix cache can reuse under the prefix-aware order versus a shuffled order (longest
   common token prefix with any earlier prompt, whitespace tokens as the scripted server counts them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time

from needlescope.cases import CaseSpec, build_cases, order_for_prefix_cache
from needlescope.targets import ChatTarget

BODY = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "1234567"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }
).encode()
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def client_rps(n: int, concurrency: int) -> float:
    server = await asyncio.start_server(_handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = ChatTarget([f"http://127.0.0.1:{port}/v1"], "bench", timeout=30, retries=0)
    sem = asyncio.Semaphore(concurrency)
    messages = [{"role": "user", "content": "What is the code? Answer with the number only."}]

    async def one() -> None:
        async with sem:
            await target.chat(messages, max_tokens=8, extra_body=None)

    await asyncio.gather(*(one() for _ in range(50)))  # warm the connection pool
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    elapsed = time.perf_counter() - t0
    await target.aclose()
    server.close()
    return n / elapsed


def _words(case) -> list[str]:
    text = " ".join(f"<|{m['role']}|> {m['content']}" for m in case.messages) + " <|assistant|>"
    return text.split()


def reuse(cases) -> tuple[int, int]:
    seen: list[list[str]] = []
    sent = reused = 0
    for case in cases:
        words = _words(case)
        sent += len(words)
        best = 0
        for prev in seen[-64:]:
            k = 0
            for a, b in zip(prev, words):
                if a != b:
                    break
                k += 1
            best = max(best, k)
        reused += best
        seen.append(words)
    return sent, reused


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    rps = asyncio.run(client_rps(args.requests, args.concurrency))
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"client throughput: {rps:.0f} req/s ({args.requests} requests, concurrency {args.concurrency})")

    def count(msgs):
        return sum(len(f"<|{m['role']}|> {m['content']}".split()) for m in msgs) + 1

    for kind in ("single", "multiturn"):
        spec = CaseSpec(
            kind=kind, lengths=(1000, 2000, 4000, 8000), depths=(0, 10, 25, 50, 75, 90, 100), trials=5, seed=0
        )
        cases = build_cases(spec, count)
        ordered = order_for_prefix_cache(cases)
        shuffled = list(cases)
        random.Random(0).shuffle(shuffled)
        sent, reused_ordered = reuse(ordered)
        _, reused_shuffled = reuse(shuffled)
        print(
            f"{kind}: {len(cases)} requests, {sent} prompt tokens sent; reusable by a prefix cache: "
            f"prefix-aware order {reused_ordered} ({reused_ordered / sent:.1%}), shuffled {reused_shuffled} "
            f"({reused_shuffled / sent:.1%})"
        )


if __name__ == "__main__":
    main()
