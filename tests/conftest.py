"""Shared fixtures: the scripted loopback server, a tiny organism training stage."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The Triton kernels run under Triton's interpreter in CI (no GPU). Triton reads this when it is
# first imported (transformers may import it early), so it is set here, before any test module;
# bench/indexer_gpu.sh sets NEEDLESCOPE_KERNEL_SHAPES=full to run them compiled on a GPU instead.
if os.environ.get("NEEDLESCOPE_KERNEL_SHAPES") != "full":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def scripted_server():
    """Factory: ``scripted_server(window=500, fail_every=3, ...)`` -> "http://127.0.0.1:PORT".

    Keyword options map to the server's flags (underscores become dashes). All started servers
    are killed at teardown.
    """
    procs: list[subprocess.Popen] = []

    def start(**opts: object) -> str:
        opts.setdefault("window", 10_000)
        args = [sys.executable, "-m", "needlescope.testing.scripted_server", "--port", "0"]
        for k, v in opts.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("READY "):
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"scripted server did not start: {line!r} {err}")
        return f"http://127.0.0.1:{int(line.split()[1])}"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


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
