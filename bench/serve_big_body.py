"""How long a 10 MB request body takes to be refused, and how `/health` answers meanwhile.

    PYTHONPATH=src python bench/serve_big_body.py [--mb 10] [-- SERVE ARGS...]

Starts `needlescope serve` (default: the shipped organism, port 0), sends one chat request
whose body is ``--mb`` megabytes of text, and polls `/health` every 50 ms from another thread
while it is in flight. Prints the refusal's status and time, the /health latencies (max and
median) and the server's RSS before and after. Numbers go to docs/serve.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from needlescope.serve.launch import ServerProcess


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("serve_args", nargs="*", default=[])
    args = ap.parse_args()
    content = "word " * int(args.mb * 2**20 / 5)
    body = json.dumps(
        {"model": "organism", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    )
    with ServerProcess(["--model", "organism", "--port", "0", *args.serve_args], timeout=300) as srv:
        before = rss_kib(srv.pid)
        latencies: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=120) as c:
                while not done.is_set():
                    t = time.perf_counter()
                    c.get(srv.url + "/health")
                    latencies.append(time.perf_counter() - t)
                    time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        t0 = time.perf_counter()
        try:
            r = httpx.post(
                srv.url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=600,
            )
            status, detail = r.status_code, r.text[:160]
        except httpx.HTTPError as exc:  # a server that answers before reading may reset the upload
            status, detail = "error", repr(exc)[:160]
        elapsed = time.perf_counter() - t0
        done.set()
        poller.join()
        after = rss_kib(srv.pid)
    print(f"body: {len(body) / 2**20:.1f} MiB -> {status} in {elapsed:.3f} s: {detail}")
    print(
        f"/health during it: {len(latencies)} polls, max {max(latencies) * 1000:.1f} ms, "
        f"median {statistics.median(latencies) * 1000:.1f} ms"
    )
    print(f"server RSS: {before} KiB before, {after} KiB after ({(after - before) / 1024:+.1f} MiB)")


if __name__ == "__main__":
    main()
