"""``needlescope probe`` against ``transformers serve`` (transformers' own OpenAI-compatible server,
a peer nobody here wrote) on the shipped organism, offline, on CPU.

transformers serve has no /tokenize, and its /v1/models fails offline (it scans the hub cache, which
does not exist: HTTP 500 CacheNotFound), so this exercises the /v1/models fallback and counting with
the checkpoint's own tokenizer.json + chat_template.jinja. The check: every case's counted length is
exactly its target and exactly the server's usage.prompt_tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("accelerate")  # transformers' serving extra
pytest.importorskip("torch")

import needlescope  # noqa: E402

WEIGHTS = Path(needlescope.__file__).parent / "organism" / "weights"
CLI = [sys.executable, "-m", "needlescope.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def transformers_serve(tmp_path_factory):
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the transformers CLI is not installed")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [exe, "serve", str(WEIGHTS), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    log = tmp_path_factory.mktemp("transformers_serve") / "server.log"
    # A file, not a pipe: its log would fill an unread pipe and stall the server.
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        else:
            pytest.fail("transformers serve did not answer /health within 240 s")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("kind", ["single", "multiturn"])
def test_counted_lengths_equal_transformers_serve_prompt_tokens(transformers_serve, tmp_path, kind):
    res = subprocess.run(
        [*CLI, "probe", "--base-url", transformers_serve + "/v1", "--model", str(WEIGHTS),
         "--tokenizer", str(WEIGHTS), "--value-digits", "3", "--kind", kind, "--lengths", "200,333",
         "--depths", "0,100", "--trials", "1", "--concurrency", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
    assert [(r["counted_length"], r["prompt_tokens"]) for r in rows] == [(r["length"],) * 2 for r in rows]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["length_mismatches"] == 0
    assert "assumed to be served" in (tmp_path / "report.md").read_text()
