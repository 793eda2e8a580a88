"""A real Prometheus server (Debian's ``prometheus``) on loopback, for tests and benchmarks.

``scripted_target(port, window)`` starts the scripted server on a fixed port, so a test can kill
it and start it again at the same address.

``PrometheusServer(workdir, ["127.0.0.1:9464"])`` writes a config that scrapes the targets every
``scrape_s`` seconds, starts ``prometheus`` on a free loopback port, waits for ``/-/ready``, and
reads values back through the HTTP query API. ``stop()`` ends it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from needlescope.serve.launch import stop_process, wait_answering
from needlescope.testing.servers import scripted

__all__ = ["PROMETHEUS", "PrometheusServer", "free_port", "scripted_target"]

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    """A loopback port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scripted_target(port: int, window: int) -> subprocess.Popen:
    """``needlescope.testing.scripted_server`` on ``port``, returned once it printed READY."""
    server = scripted(port=port, window=window).start()
    assert server.proc is not None
    return server.proc


class PrometheusServer:
    def __init__(
        self, workdir: Path, targets: list[str], *, scrape_s: int = 1, job: str = "needlescope-canary"
    ):
        if PROMETHEUS is None:
            raise RuntimeError("prometheus is not installed; `make deps` installs Debian's package")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = Path(workdir) / "prometheus.yml"
        listed = ", ".join(f"'{t}'" for t in targets)
        config.write_text(
            f"global:\n  scrape_interval: {scrape_s}s\n  scrape_timeout: {scrape_s}s\n"
            f"scrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: [{listed}]\n"
        )
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={Path(workdir) / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if not wait_answering(self.url + "/-/ready", self.proc, timeout=60):
            self.stop()
            raise RuntimeError(f"prometheus did not become ready: {self.proc.stderr.read()[-2000:]}")

    def query_raw(self, expr: str) -> dict:
        """The API's JSON answer to an instant query."""
        body = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5).json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body

    def query(self, expr: str) -> dict[tuple, float]:
        """{sorted label items other than __name__, job and instance: value}."""
        out = {}
        for row in self.query_raw(expr)["data"]["result"]:
            labels = {k: v for k, v in row["metric"].items() if k not in ("__name__", "job", "instance")}
            out[tuple(sorted(labels.items()))] = float(row["value"][1])
        return out

    def value(self, expr: str) -> float:
        """The value of a query that selects exactly one series."""
        (v,) = self.query(expr).values()
        return v

    def wait_for(self, expr: str, ok: Callable[[dict], bool], timeout: float = 30.0) -> tuple[dict, float]:
        """Poll ``expr`` until ``ok(result)`` holds; return the result and the seconds it took."""
        start = time.monotonic()
        result: dict = {}
        while time.monotonic() - start < timeout:
            result = self.query(expr)
            if result and ok(result):
                return result, time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"{expr} never satisfied the condition in {timeout}s; last: {result}")

    def stop(self) -> None:
        stop_process(self.proc)
