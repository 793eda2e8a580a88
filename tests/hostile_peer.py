"""A hostile OpenAI-compatible peer (stdlib, loopback): it answers the discovery requests a client
makes first (``/v1/models``, ``/tokenize``, a one-token chat ping) like a healthy server, and every
other request one of three ways:

- ``endless``: 200 with JSON headers, then spaces without end (JSON whitespace never closes);
- ``trickle``: 200 with a Content-Length of 100 kB, then one byte every ``byte_every_s``;
- ``trickle-headers``: the status line, then header bytes one every ``byte_every_s``;
- ``refuse``: HTTP 400 with one fixed error message (a target refusing every probe);
  ``/health`` answers 200.

Other GETs and POSTs (server info, metrics) get 404, as from a server without them.

``/health`` behaves the same way, so ``health`` meets it on its first GET. Every answer stops
after ``limit_s`` seconds whatever the client does, so a test cannot leave a busy thread behind.
A byte every ``byte_every_s`` (0.25 s) keeps a client with a per-read timeout of a second or more
reading forever: only a bound on the whole request ends it.

    python tests/hostile_peer.py MODE      # prints the port, serves until killed
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from needlescope.testing.scripted_server import render_words

MODES = ("endless", "trickle", "trickle-headers", "refuse")


def _handler(mode: str, limit_s: float, byte_every_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _json(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _hostile(self) -> None:
            if mode == "refuse":
                data = json.dumps(
                    {"error": {"message": "prompt rejected by policy", "code": "policy"}}
                ).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            end = time.monotonic() + limit_s
            try:
                if mode == "trickle-headers":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    while time.monotonic() < end:
                        self.wfile.write(b"X")
                        self.wfile.flush()
                        time.sleep(byte_every_s)
                    return
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                if mode == "trickle":
                    self.wfile.write(b"Content-Length: 100000\r\n\r\n{")
                    while time.monotonic() < end:
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(byte_every_s)
                    return
                self.wfile.write(b"Connection: close\r\n\r\n{")
                chunk = b" " * 65536
                while time.monotonic() < end:
                    self.wfile.write(chunk)
            except OSError:
                pass  # the client gave up: what the test wants
            finally:
                self.close_connection = True

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                self._json({"object": "list", "data": [{"id": "m", "object": "model"}]})
            elif self.path == "/health" and mode == "refuse":
                self._json({"status": "ok"})
            elif self.path == "/health":
                self._hostile()
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/tokenize" and "messages" in body:
                self._json(
                    {"count": len(render_words(body["messages"], body.get("add_generation_prompt", True)))}
                )
            elif self.path == "/tokenize":
                self._json({"tokens": list(range(len(str(body.get("prompt", "")).split())))})
            elif not self.path.endswith("completions"):
                self.send_error(404)
            elif body.get("max_tokens") == 1 and body.get("messages") == [
                {"role": "user", "content": "ping"}
            ]:
                self._json({"choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}}]})
            else:
                self._hostile()

    return Handler


class HostilePeer:
    """The peer on a free loopback port, in daemon threads; ``url`` is its root."""

    def __init__(self, mode: str, limit_s: float = 30.0, byte_every_s: float = 0.25) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        ThreadingHTTPServer.daemon_threads = True
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(mode, limit_s, byte_every_s))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HostilePeer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    peer = HostilePeer(sys.argv[1])
    print(peer.url.rsplit(":", 1)[1], flush=True)
    with peer:
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
