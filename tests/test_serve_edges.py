"""``needlescope serve`` at the edges of issue 29: slow and half-open clients, many tiny messages,
shutdown with requests waiting, and the peer-visible details (Retry-After, /detokenize,
continue_final_message, logit_bias keys). A real server child on loopback; raw sockets, httpx and
the official openai client as callers."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from needlescope.serve.launch import ChildServer
from needlescope.testing.checkpoints import save_random

SMALL = dict(
    hidden_size=64,
    q_lora_rank=32,
    o_lora_rank=32,
    moe_intermediate_size=64,
    index_topk=8,
    max_position_embeddings=512,
)
NAME = "tiny"
FD_LIMIT = 1024
HALF_OPEN = 2000


def _serve_argv(ckpt: Path, *flags: str, fd_limit: int | None = None) -> list[str]:
    """``needlescope serve`` as a child, optionally under a lower descriptor limit (as on a host
    with the common default of 1024), so 2,000 connections are more than it can hold."""
    args = ["serve", "--model", str(ckpt), "--port", "0", "--served-model-name", NAME, *flags]
    limit = (
        "" if fd_limit is None else f"resource.setrlimit(resource.RLIMIT_NOFILE, ({fd_limit}, {fd_limit}));"
    )
    code = f"import resource, runpy, sys;{limit}sys.argv = ['needlescope'] + sys.argv[1:];"
    code += "runpy.run_module('needlescope.cli.main', run_name='__main__')"
    return [sys.executable, "-c", code, *args]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("ckpt"), seed=3, **SMALL)


HEADER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server(ckpt):
    argv = _serve_argv(ckpt, "--header-timeout", str(HEADER_TIMEOUT), fd_limit=FD_LIMIT)
    with ChildServer(argv, health_path="/health") as srv:
        yield srv


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_half_open_connections_do_not_lock_out_health(server):
    """2,000 connections that each send part of a request head, against a server allowed 1,024
    descriptors: /health still answers, the half-open connections are closed after the header
    deadline, and the log says so in a few lines, not one per connection. Before the fix the
    server held every connection and /health got nothing."""
    srv = server
    socks = []
    try:
        for _ in range(HALF_OPEN):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        start = time.monotonic()
        resp = httpx.get(srv.url + "/health", timeout=5)
        took = time.monotonic() - start
        assert resp.status_code == 200
        print(f"/health after {HALF_OPEN} half-open connections: {took * 1000:.0f} ms")
        assert _open_fds(srv.pid) < FD_LIMIT
        time.sleep(HEADER_TIMEOUT + 1.0)  # the header deadline of the connections still open
        assert _open_fds(srv.pid) < 100, "half-open connections outlived the header deadline"
    finally:
        for s in socks:
            s.close()
    log = srv.stderr
    assert log.count("connection cap") <= 2 and "connection cap of" in log, log[-2000:]
    assert log.count("no complete request head") == 1, log[-2000:]
    assert "Traceback" not in log, log[-2000:]


def test_trickled_head_is_closed_at_the_deadline(server):
    """A head sent a byte at a time does not move the deadline: the connection is closed about
    ``--header-timeout`` after its first byte although bytes keep coming."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    start = time.monotonic()
    closed_after = None
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: trickle\r\nX-Slow: " + b"a" * 100:
            s.sendall(bytes([byte]))
            time.sleep(0.1)
    except OSError:
        closed_after = time.monotonic() - start
    finally:
        s.close()
    if closed_after is None:
        closed_after = time.monotonic() - start
    assert closed_after < HEADER_TIMEOUT + 3, f"the trickling connection stayed open {closed_after:.1f}s"
