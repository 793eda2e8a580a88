"""Shared fixtures: the scripted loopback server, a tiny organism training stage."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

# Bytecode is written and reused during the run, whatever the environment says: under
# PYTHONDONTWRITEBYTECODE=1 (set on the box the suite is timed on) nothing is written, so with
# the Makefile's --no-compile venv every server and CLI child the tests start compiles torch,
# transformers and needlescope from source again (importing the serve app and the CLI: 14.4 s
# without bytecode, 4.7 s with it), and src/ is compiled again in every child regardless.
# Before torch is first imported; the children inherit it. __pycache__/ is git-ignored.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Each xdist worker (and every CLI child it starts) gets its share of the cores: torch's default
# of one thread per core in each of `make test`'s two workers oversubscribed the 2-core box (one
# compare-dump test file: 131 s wall / 59 s CPU by default, 63 s / 17.5 s with one thread each).
# Set before torch is first imported.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402

from needlescope.serve.launch import ChildServer  # noqa: E402
from needlescope.testing.servers import scripted  # noqa: E402

# The Triton kernels run under Triton's interpreter in CI (no GPU). Triton reads this when it is
# first imported (transformers may import it early), so it is set here, before any test module;
# bench/indexer_gpu.sh sets NEEDLESCOPE_KERNEL_SHAPES=full to run them compiled on a GPU instead.
if os.environ.get("NEEDLESCOPE_KERNEL_SHAPES") != "full":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton_interpreter  # noqa: E402  (tests/: helper calls skip a redundant re-patch)

    triton_interpreter.install()

# Under xdist, a ledger's `threads` (2 unless it says otherwise) or an in-process engine's asked
# torch for more than the share, in both workers at once, and it stayed so for every later test of
# that worker: four busy threads on two cores. test_investigate_unnamed's fixture beside one
# busy core: 26 s with 2 threads, 13 s with 1 (12.6 s vs 11.8 s alone). So under xdist torch's
# intra-op threads stay at most the share; the ledger's value is still what it validates and
# records, and a run without -n sets what it asks for.
if _WORKERS > 1 and importlib.util.find_spec("torch") is not None:
    import torch

    _SHARE = int(os.environ["OMP_NUM_THREADS"])
    _set_num_threads = torch.set_num_threads

    @functools.wraps(_set_num_threads)
    def _set_at_most_the_share(n: int) -> None:
        _set_num_threads(min(n, _SHARE))

    torch.set_num_threads = _set_at_most_the_share


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Longest files first (``schedule``): `make test`'s workers take whole files in this order."""
    from schedule import load_seconds, longest_files_first

    items[:] = longest_files_first(items, load_seconds())


@pytest.fixture
def scripted_server():
    """Factory: ``scripted_server(window=500, fail_every=3, ...)`` -> "http://127.0.0.1:PORT".

    Keyword options map to the server's flags (``needlescope.testing.servers.scripted``). All
    started servers are stopped at teardown.
    """
    started: list[ChildServer] = []

    def start(**opts: object) -> str:
        server = scripted(**opts)
        started.append(server)
        return server.start().url

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def organism_server():
    """Factory: ``organism_server(*flags)`` -> "http://127.0.0.1:PORT" of ``needlescope serve
    --model organism --port 0 *flags``, started once per worker for each set of flags and shared
    by the files asking for the same flags (``shared_servers``); all are stopped at the end."""
    from shared_servers import SharedOrganismServers

    servers = SharedOrganismServers()
    yield servers.get
    servers.stop()


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """``run_cli("indexer", "diff", ...)``: the real ``needlescope`` entry point in-process.

    Returns (exit code, stdout, stderr); a BadInput exits 2 through ``main`` as on the shell.
    """
    from needlescope.cli import main as cli_main

    def run(*argv: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["needlescope", *argv])
        code = 0
        try:
            cli_main.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def run_cli_completed(run_cli):
    """``run_cli`` answering as ``subprocess.run`` does (``.returncode``, ``.stdout``, ``.stderr``):
    for a test of a command's arguments and messages that once ran it in a child, which spent
    seconds importing torch and transformers before the command did anything."""
    import subprocess

    def run(*argv: str) -> subprocess.CompletedProcess:
        code, out, err = run_cli(*argv)
        return subprocess.CompletedProcess(["needlescope", *argv], code, out, err)

    return run


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """Factory: ``built_once(name, build)`` -> a directory that ``build(directory)`` filled once
    for the whole test run, whichever xdist worker asked first; a worker asking meanwhile waits
    for it. For a module fixture that xdist would otherwise compute again in the other worker
    when a module's tests land in both (`make test` hands out whole files, but a plain
    ``pytest -n 2`` splits them). Callers only read the directory."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's, shared

    def get(name: str, build) -> Path:
        directory = root / f"built-once-{name}"
        with open(root / f"built-once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an error
            if not (directory / ".built").exists():
                shutil.rmtree(directory, ignore_errors=True)  # a build that failed part-way
                directory.mkdir()
                build(directory)
                (directory / ".built").touch()
        return directory

    return get


@pytest.fixture
def tiny_train() -> dict:
    """``TrainConfig`` keywords for a seconds-long CPU stage (32-wide model, short examples, no eval)."""
    return dict(
        tokens_per_batch=1024,
        min_len=128,
        max_len=256,
        workers=0,
        eval_examples=0,
        warmup=1,
        log_every=1,
        config_overrides={"hidden_size": 32, "moe_intermediate_size": 32},
    )
