"""Start ``needlescope serve`` as a child process and wait until it answers (tests, demo, bench).

``ServerProcess(["--model", DIR, "--port", "0"])`` runs the real CLI
(``python -m needlescope.cli.main serve ...``), reads its ``READY <port>`` line, then polls
``/health`` until it answers 200. Used as a context manager it kills the server on exit.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

__all__ = ["SERVE_ARGV", "ServerProcess"]

SERVE_ARGV = (sys.executable, "-m", "needlescope.cli.main", "serve")


class ServerProcess:
    def __init__(self, args: Sequence[str], *, timeout: float = 120.0, host: str = "127.0.0.1") -> None:
        self.args = list(args)
        self.timeout = timeout
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._stderr: list[str] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            [*SERVE_ARGV, *self.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        # Drain stderr continuously so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY "):
            self.proc.wait(timeout=30)
            time.sleep(0.2)
            raise RuntimeError(
                f"needlescope serve did not start (exit {self.proc.returncode}, said {line!r}): {self.stderr[-2000:]}"
            )
        self.port = int(line.split()[1])
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"needlescope serve never became healthy: {self.stderr[-2000:]}")
            time.sleep(0.1)

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
