"""``transformers serve`` (transformers' own OpenAI-compatible server) on a copy of the organism,
for the test files that drive it as a peer nobody here wrote: a copy with a deployment
``index_topk`` (``organism_copy``) and servers started together, each with an optional
directory on its PYTHONPATH whose ``sitecustomize.py`` plants a bug before the server loads
anything (``started``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

import needlescope

WEIGHTS = Path(needlescope.__file__).parent / "organism" / "weights"
START_S = 240
"""How long the servers get, together, to answer /health (imports dominate; minutes on a loaded box)."""


def transformers_cli() -> str:
    """The ``transformers`` CLI of this interpreter's environment (the test is skipped without it)."""
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the transformers CLI is not installed")
    return exe


def organism_copy(directory: Path, index_topk: int) -> Path:
    """A copy of the organism at ``directory`` whose ``config.json`` says ``index_topk``."""
    shutil.copytree(WEIGHTS, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "index_topk": index_topk}, indent=2))
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(exe: str, weights: Path, log: Path, pythonpath: Path | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    cmd = [exe, "serve", str(weights), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    # A file, not a pipe: its log would fill an unread pipe and stall the server.
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, url: str, log: Path, deadline: float) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"transformers serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"transformers serve did not answer /health within {START_S} s: {log.read_text()[-2000:]}")


def plant(directory: Path, code: str) -> Path:
    """``directory`` holding ``sitecustomize.py`` = ``code`` (a PYTHONPATH entry for ``started``)."""
    directory.mkdir(parents=True)
    (directory / "sitecustomize.py").write_text(code)
    return directory


@contextmanager
def started(weights: Path, pythonpaths: dict[str, Path | None], logs: Path) -> Iterator[dict[str, str]]:
    """{name: root URL} of one ``transformers serve weights`` per name, all started at once (their
    imports overlap) with that name's PYTHONPATH entry (None: none), each logging to
    ``logs/NAME.log``; all are killed on exit."""
    exe = transformers_cli()
    with ExitStack() as stack:
        running = {}
        for name, path in pythonpaths.items():
            proc, url = _start(exe, weights, logs / f"{name}.log", path)
            stack.callback(lambda p=proc: (p.kill(), p.wait(timeout=30)))
            running[name] = (proc, url)
        deadline = time.time() + START_S
        for name, (proc, url) in running.items():
            _wait(proc, url, logs / f"{name}.log", deadline)
        yield {name: url for name, (_, url) in running.items()}
