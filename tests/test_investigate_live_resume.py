"""A live run resumes against its server restarted on another port (the server is identified by
its /get_server_info configuration, not its URL: ``measure.server_identity``); a different server
at the ledger's endpoint is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from live_ledgers import live_suspect, write_live_ledger
from needlescope.errors import BadInput
from needlescope.investigate.measure.server_identity import check_same_server, resume_text

pytest.importorskip("torch")

CASES = 4


def _ledger(directory, url: str):
    return write_live_ledger(
        directory, url, lengths="[256]", depths="[0, 33, 67, 100]", trials=1, max_new_tokens=4,
        suspects=[live_suspect("index_topk", "top-16 drops the needle", 'setting = "topk=16"')],
    )  # fmt: skip


def _server():
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    # the checkpoint's own numerics: no case fails, so nothing but the symptom is measured (cheap)
    cfg = ServeConfig(model="organism", port=0, setting=Setting.parse("k=fp32"), threads=1)
    return ServerProcess(cfg, timeout=300)


def _killed_after_first_case(ledger, out) -> int:
    """``investigate run`` in a child, SIGKILLed once its first live case is on disk; the cases
    it had written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "needlescope.cli.main", "investigate", "run", str(ledger), "--out", str(out)]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    live = out / "measure" / "live.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and child.poll() is None:
        if live.exists() and live.read_text().count("\n") >= 1:
            break
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    return live.read_text().count("\n") if live.exists() else 0


def test_a_live_run_resumes_against_its_server_on_a_new_port(tmp_path):
    from needlescope.investigate.run import run_investigation

    out = tmp_path / "out"
    with _server() as first:
        written = _killed_after_first_case(_ledger(tmp_path, first.url), out)
        before = (out / "measure" / "live.jsonl").read_text().splitlines()
        digest = json.loads((out / "state.json").read_text())["ledger_sha256"]
        first_port = first.url
    assert 1 <= written < CASES, written  # killed mid-run
    with _server() as second:
        assert second.url != first_port
        run_investigation(_ledger(tmp_path, second.url), out)  # the endpoint edited: same run
    after = [json.loads(x) for x in (out / "measure" / "live.jsonl").read_text().splitlines()]
    ids = [r["case_id"] for r in after]
    assert len(ids) == len(set(ids)) == CASES, ids  # no case twice, none lost
    assert (out / "measure" / "live.jsonl").read_text().splitlines()[: len(before)] == before
    assert json.loads((out / "state.json").read_text())["ledger_sha256"] == digest
    assert json.loads((out / "verdicts.json").read_text())["symptom"]["errors"] == 0


def test_a_different_server_at_the_endpoint_is_refused():
    stored = {"model": "organism", "index_k": "fp32", "index_topk": 16, "device": "cpu", "threads": 1}
    check_same_server(stored, {**stored, "threads": 4}, "http://127.0.0.1:2")  # no answer changes
    check_same_server(None, stored, "http://127.0.0.1:2")  # a first run: nothing to compare
    with pytest.raises(BadInput, match=r"index_topk 16 -> 64.*new --out"):
        check_same_server(stored, {**stored, "index_topk": 64}, "http://127.0.0.1:2")
    a = 'candidate = "live"\nendpoint = "http://127.0.0.1:8001"\n'
    assert resume_text(a) == resume_text(a.replace("8001", "9002")) != a
