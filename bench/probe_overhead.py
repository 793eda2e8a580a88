"""Client overhead of the probe, and how much of a standard sweep a prefix cache can reuse.

    .venv/bin/python bench/probe_overhead.py [--requests 3000] [--concurrency 64] [--profile FILE]

1. Requests per second that ChatTarget sustains against a zero-latency loopback server (asyncio
   streams answering a fixed completion) running in ANOTHER process, so the server neither shares
   the client's event loop nor is the bottleneck being measured. ``--profile FILE`` also writes a
   cProfile of the client's timed part and prints its top functions.
2. Prompt tokens a standard sweep (4 lengths x 7 depths x 5 trials) sends, and how many tokens a
   server-side prefix cache can reuse under the prefix-aware order versus a shuffled order (longest
   common token prefix with any earlier prompt, whitespace tokens as the scripted server counts them).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import pstats
import random
import time
from pathlib import Path

import httpx

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


async def _serve(port_out: multiprocessing.connection.Connection) -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", 0)
    port_out.send(server.sockets[0].getsockname()[1])
    await server.serve_forever()


def _server_process(port_out: multiprocessing.connection.Connection) -> None:
    asyncio.run(_serve(port_out))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client_rps(
    port: int, server_pid: int, n: int, concurrency: int, profile: str | None
) -> tuple[float, float, float]:
    """(requests per wall second, per CPU second of this client, per CPU second of the server).

    The CPU rates do not depend on what else the machine runs: each is the rate one dedicated
    core would sustain for that side alone, so on 2 idle cores the pair sustains about the lower."""
    target = ChatTarget(
        [f"http://127.0.0.1:{port}/v1"], "bench", timeout=30, retries=0, concurrency=concurrency
    )
    sem = asyncio.Semaphore(concurrency)
    messages = [{"role": "user", "content": "What is the code? Answer with the number only."}]

    async def one() -> None:
        async with sem:
            await target.chat(messages, max_tokens=8, extra_body=None)

    await asyncio.gather(*(one() for _ in range(max(50, concurrency))))  # warm the connection pool
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    t0, c0, s0 = time.perf_counter(), time.process_time(), _cpu_s(server_pid)
    await asyncio.gather(*(one() for _ in range(n)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    server_cpu = _cpu_s(server_pid) - s0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    await target.aclose()
    return n / elapsed, n / cpu, n / max(server_cpu, 1e-9)


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
    ap.add_argument("--profile", default=None, help="write a cProfile of the client's timed part here")
    args = ap.parse_args()
    parent, child = multiprocessing.Pipe()
    server = multiprocessing.Process(target=_server_process, args=(child,), daemon=True)
    server.start()
    try:
        port = parent.recv()
        rps, per_cpu, server_per_cpu = asyncio.run(
            client_rps(port, server.pid, args.requests, args.concurrency, args.profile)
        )
    finally:
        server.terminate()
        server.join()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, httpx {httpx.__version__}"
    )
    load = os.getloadavg()[0]
    print(
        f"client throughput: {rps:.0f} req/s wall ({args.requests} requests, concurrency "
        f"{args.concurrency}, server in another process, load average {load:.1f}); "
        f"{per_cpu:.0f} req per client CPU second, {server_per_cpu:.0f} per server CPU second; "
        f"on 2 idle cores (one each): about {min(per_cpu, server_per_cpu):.0f} req/s"
    )

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
