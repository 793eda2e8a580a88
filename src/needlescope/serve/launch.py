"""Start a server as a child process and wait until it answers (serve-probe-explain, tests, bench).

Both of needlescope's servers announce themselves the same way: the first line on stdout is
``READY <port>``. ``ChildServer(argv)`` runs ``argv``, reads that line (the one implementation
of the handshake), optionally polls a health path until it answers 200, and, used as a context
manager, stops the process on exit. No such server outlives the process that started it, however
that process dies (SIGKILL included): the child learns its parent's pid from
``NEEDLESCOPE_PARENT_PID`` and stops itself when the parent is gone (``parent_watch``), and a child
started from the main thread also gets Linux's parent-death signal, which is immediate (Linux ties
that signal to the starting thread, so from other threads it is not asked for).

``ServerProcess(ServeConfig(model=DIR, port=0))`` is ``needlescope serve`` started with the
whole config as JSON (``python -m needlescope.cli.main serve --config-json ...``), so the
child runs exactly that config, setting and patch included; ``ServerProcess(["--model", DIR])``
passes flags instead (tests of the flags themselves). It waits for ``/health``. An API key
travels in the child's ``NEEDLESCOPE_API_KEY``, never in its arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

from needlescope.errors import BadInput
from needlescope.serve.config import ServeConfig
from needlescope.serve.parent_watch import PARENT_ENV

__all__ = ["SERVE_ARGV", "ChildServer", "ServerProcess", "stop_process", "wait_answering"]

SERVE_ARGV = (sys.executable, "-m", "needlescope.cli.main", "serve")


def wait_answering(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll ``GET url`` until it answers 200 (True), or until ``proc`` exits or ``timeout``
    seconds pass (False). Connection errors while the child starts up are expected."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            return False
        time.sleep(0.1)


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when its parent dies, so a server
    outlives no serve-probe-explain, test or bench killed with SIGKILL (``prctl(PR_SET_PDEATHSIG)``)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate ``proc`` if it still runs and wait for it; kill it if it outlives ``timeout``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


class ChildServer:
    """A child process that prints ``READY <port>`` when it listens on ``host``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        health_path: str | None = None,
        timeout: float = 120.0,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.health_path = health_path
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

    @property
    def name(self) -> str:
        return " ".join(self.argv[1:4])

    def start(self) -> ChildServer:
        # The parent-death signal fires when the starting *thread* ends, so it is asked for only
        # from the main thread: a server started from a pool thread (tests start several at once)
        # would otherwise be killed as soon as that thread finishes; the child's parent watch
        # covers those.
        on_main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**(os.environ if self.env is None else self.env), PARENT_ENV: str(os.getpid())},
            preexec_fn=_die_with_parent if on_main else None,
        )
        # Drain stderr continuously so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY "):
            self.proc.wait(timeout=30)
            time.sleep(0.2)
            if self.proc.returncode == 2 and self.stderr.strip():
                # The child refused its input (one line, exit 2): that line is the parent's error too.
                raise BadInput(self.stderr.strip().splitlines()[-1].removeprefix("error: "))
            raise RuntimeError(
                f"{self.name} did not start (exit {self.proc.returncode}, said {line!r}): {self.stderr[-2000:]}"
            )
        self.port = int(line.split()[1])
        if self.health_path is not None and not wait_answering(
            self.url + self.health_path, self.proc, self.timeout
        ):
            self.stop()
            raise RuntimeError(f"{self.name} never became healthy: {self.stderr[-2000:]}")
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> ChildServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ChildServer):
    """``needlescope serve`` as a child: from a ``ServeConfig`` (as JSON) or from flags."""

    def __init__(
        self, config: ServeConfig | Sequence[str], *, timeout: float = 120.0, host: str = "127.0.0.1"
    ) -> None:
        env = None
        if isinstance(config, ServeConfig):
            args = ["--config-json", config.to_json()]
            if config.api_key is not None:  # never on a command line, which every local user can read
                env = {**os.environ, "NEEDLESCOPE_API_KEY": config.api_key}
        else:
            args = list(config)
        super().__init__([*SERVE_ARGV, *args], health_path="/health", timeout=timeout, host=host, env=env)
        self.args = args

    @property
    def name(self) -> str:
        return "needlescope serve"

    def __enter__(self) -> ServerProcess:
        self.start()
        return self
