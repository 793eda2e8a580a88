"""Whether `/health` stays on the air while stalled uploads fill the connection cap (issue 38, R1).

    PYTHONPATH=src python bench/serve_stalled_bodies.py [--connections 1030] [--polls 20]

Starts `needlescope serve` on a random tiny checkpoint under a descriptor limit of 1,024 (as on a
host with the common default), opens ``--connections`` connections that each send a complete
``POST`` head with ``Content-Length: 100`` and no body, then polls `/health` once a second
(2 s client timeout). Prints how many polls were answered, the slowest answer, the descriptors
the server holds and the size of its log. Numbers go to docs/serve.md ("Limits").
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from needlescope.serve.launch import ChildServer
from needlescope.testing.checkpoints import TINY_SERVE, save_random

HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n"
)
FD_LIMIT = 1024


def serve_argv(ckpt: Path) -> list[str]:
    """``needlescope serve`` under a descriptor limit of ``FD_LIMIT``."""
    code = (
        f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT}));"
        "sys.argv = ['needlescope'] + sys.argv[1:]; runpy.run_module('needlescope.cli.main', run_name='__main__')"
    )
    return [sys.executable, "-c", code, "serve", "--model", str(ckpt), "--port", "0"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=1030)
    ap.add_argument("--polls", type=int, default=20)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.connections + 256)), hard))
    ckpt = save_random(Path(tempfile.mkdtemp()), seed=3, **TINY_SERVE)
    with ChildServer(serve_argv(ckpt), health_path="/health") as srv:
        socks = []
        for _ in range(args.connections):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(HEAD)
            socks.append(s)
        answered = []
        for _ in range(args.polls):
            start = time.monotonic()
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    answered.append(time.monotonic() - start)
            except httpx.HTTPError:
                pass
            time.sleep(max(0.0, 1 - (time.monotonic() - start)))
        held = len(os.listdir(f"/proc/{srv.pid}/fd"))
        for s in socks:
            s.close()
        time.sleep(0.5)
        log = srv.stderr
    slowest = f"{max(answered) * 1000:.0f} ms" if answered else "-"
    print(
        f"/health answered {len(answered)} of {args.polls} polls; slowest {slowest}; descriptors held {held}"
    )
    print(f"server log: {len(log)} bytes, {log.count('Traceback')} tracebacks")
    print(log)


if __name__ == "__main__":
    main()
