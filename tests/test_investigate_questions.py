"""Cheap questions against real sources: env files, /proc, a loopback HTTP server, safetensors headers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from needlescope.dsa.checkpoint import shipped_dir
from needlescope.investigate.ledger.ledger import Question
from needlescope.investigate.measure.questions import QuestionContext, answer


def ctx(tmp_path, **kw):
    return QuestionContext(base=tmp_path, checkpoint=kw.pop("checkpoint", shipped_dir()), **kw)


def test_env_file_and_process(tmp_path):
    (tmp_path / "dep.env").write_text("# comment\nexport A_FLAG=1\nB='x y'\n")
    c = ctx(tmp_path, env_file=tmp_path / "dep.env")
    assert answer(Question("env", {"name": "A_FLAG"}), c).value == "1"
    assert answer(Question("env", {"name": "B"}), c).value == "x y"
    assert answer(Question("env", {"name": "C"}), c).value == "<unset>"
    # A child with a known start-up environment: the test's own /proc/self/environ is not one
    # (pytest-xdist's process titles, through setproctitle, overwrite that memory). The child
    # says when it runs: Popen returns once exec has begun, and until the kernel has set up the
    # new image /proc/PID/environ reads empty (CI read '<unset>' in that window).
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        env={"PATH": os.environ["PATH"], "NEEDLESCOPE_TEST_FLAG": "on"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        a = answer(Question("env", {"name": "NEEDLESCOPE_TEST_FLAG", "process": child.pid}), c)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert a.ok and a.value == "on"


def test_env_unreadable_process_is_blocked(tmp_path):
    a = answer(Question("env", {"name": "X", "process": 2**22 + 7}), ctx(tmp_path))
    assert not a.ok and "cannot read the environment" in a.blocked
    a = answer(Question("env", {"name": "X"}), ctx(tmp_path))
    assert not a.ok and "no process and no env file" in a.blocked


@pytest.fixture
def info_server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            bodies = {
                "/get_server_info": {
                    "server_args": {"enable_thinking": False, "index_topk": 512},
                    "api_key": "sk-secret",
                },
                "/v1/models": {"data": [{"id": "dsv4", "max_model_len": 65536}]},
            }
            body = bodies.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_server_info_fields(tmp_path, info_server):
    c = ctx(tmp_path, endpoint=info_server + "/v1")
    assert answer(Question("server_info", {"field": "server_args.index_topk"}), c).value == "512"
    assert answer(Question("server_info", {"field": "enable_thinking"}), c).value == "false"
    assert answer(Question("server_info", {"field": "max_model_len"}), c).value == "65536"
    assert answer(Question("server_info", {"field": "nope"}), c).value == "<absent>"


def test_server_info_unreachable_is_blocked(tmp_path):
    a = answer(Question("server_info", {"field": "x"}), ctx(tmp_path, endpoint="http://127.0.0.1:9"))
    assert not a.ok and "unreachable" in a.blocked


def test_checkpoint_dtype_config_and_source(tmp_path):
    c = ctx(tmp_path)
    a = answer(Question("checkpoint_dtype", {"pattern": "model.layers.*.hc_*_fn"}), c)
    assert a.value == "BF16" and a.detail.startswith("10 tensors")
    assert answer(Question("checkpoint_dtype", {"pattern": "nothing.*"}), c).value == "<none>"
    assert answer(Question("config", {"key": "routed_scaling_factor"}), c).value == "1.5"
    assert answer(Question("config", {"key": "compress_rates.compressed_sparse_attention"}), c).value == "4"
    (tmp_path / "p.py").write_text("w * f\nw * f * f\n")
    assert answer(Question("source", {"path": "*.py", "pattern": r"\* f"}), c).value == "3"
    assert not answer(Question("source", {"path": "none/*.py", "pattern": "x"}), c).ok
    assert not answer(Question("checkpoint_dtype", {"pattern": "*"}), ctx(tmp_path, checkpoint=tmp_path)).ok


def test_a_catastrophic_source_pattern_ends_and_is_blocked_past_its_time_bound(tmp_path):
    """Issue 38 R17: "(a+)+$" on a run of a's followed by another character backtracks for ages
    under ``re`` (the run hung). It now answers (no match); a pattern that still backtracks,
    "(a|aa)+$", is blocked once its time bound passes, with the pattern named."""
    (tmp_path / "p.py").write_text("a" * 40 + "!\n")
    c = ctx(tmp_path)
    assert answer(Question("source", {"path": "*.py", "pattern": "(a+)+$"}), c).value == "0"
    a = answer(Question("source", {"path": "*.py", "pattern": "(a|aa)+$"}), c)
    assert not a.ok and "(a|aa)+$" in a.blocked and "backtracking" in a.blocked
