"""Servers for tests: the scripted server as a child, started through the one READY handshake,
and any stdlib request handler served in this process (``in_thread``)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

from needlescope.serve.launch import ChildServer
from needlescope.testing.scripted_server import LoopbackServer

__all__ = ["JsonHandler", "in_thread", "scripted"]


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler that answers JSON (``_send``): the base of the peers tests write
    to play an engine with a quirk (``in_thread`` serves them)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        return

    def _send(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        """``body`` as JSON (Python's: a NaN or an infinity goes out as Python writes it, as some
        servers do) with its Content-Length, so the connection stays usable."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


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
