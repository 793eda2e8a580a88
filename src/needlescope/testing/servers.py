"""Servers for tests: the scripted server as a child, started through the one READY handshake,
and any stdlib request handler served in this process (``in_thread``)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

from needlescope.serve.launch import ChildServer
from needlescope.testing.scripted_server import LoopbackServer

__all__ = ["in_thread", "scripted"]


@contextmanager
def in_thread(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on a free loopback port in daemon threads; yields the root URL and
    stops the server on exit."""
    server = LoopbackServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def scripted(**opts: object) -> ChildServer:
    """``python -m needlescope.testing.scripted_server`` with ``opts`` as flags (underscores
    become dashes; ``port`` defaults to 0, a free port, and ``window`` to 10000), not yet started."""
    opts = {"port": 0, "window": 10_000, **opts}
    argv = [sys.executable, "-m", "needlescope.testing.scripted_server"]
    for k, v in opts.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return ChildServer(argv)
