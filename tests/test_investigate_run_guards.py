"""What stops an investigation run, in one line and exit 2, and what a rerun keeps (issue 38):
an endpoint that answers nothing usable, a run directory another run holds or that cannot be
written; a rerun after failed requests or a kill measures again what it must and never twice."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from live_ledgers import live_suspect, write_live_ledger
from needlescope.errors import BadInput
from needlescope.investigate.ledger.example import EXAMPLE_LEDGER, write_example
from needlescope.investigate.ledger.ledger import load_ledger
from needlescope.investigate.ledger.plan import Config
from needlescope.investigate.measure.session import Session, measure_suspects
from needlescope.investigate.measure.state import run_lock
from needlescope.setting import Setting

CLI = [sys.executable, "-m", "needlescope.cli.main"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The command in a child process: where the other side of a lock must be another process
    (flock is per open file); the other tests run it in-process through ``run_cli_completed``."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=600)


def _blocked_ledger(tmp_path: Path) -> Path:
    """The example ledger on a checkpoint that does not exist (parses fast, loads no model)."""
    write_example(tmp_path)
    path = tmp_path / "investigation.toml"
    path.write_text(EXAMPLE_LEDGER.replace('model = "organism"', f'model = "{tmp_path / "no-model"}"'))
    return path


def _live_ledger(directory: Path, url: str) -> Path:
    return write_live_ledger(
        directory, url, lengths="[512]", depths="[0, 100]", trials=1, max_new_tokens=4,
        suspects=[live_suspect("page_table", "the page table", 'patch = "fault:indexer_page_table"')],
    )  # fmt: skip


class _Stub(BaseHTTPRequestHandler):
    """A loopback endpoint that answers wrongly in one way (``server.mode``)."""

    def _answer(self) -> None:
        mode = self.server.mode
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error")
            return
        if mode == "garbage":
            body = b"<html>not json</html>"
        elif self.path.endswith("server_info"):
            body = json.dumps({"index_topk": 16}).encode()
        else:  # capture-less: a generation without indexer_topk
            meta = {"prompt_tokens": 10, "completion_tokens": 1}
            body = json.dumps({"text": "7", "meta_info": meta, "output_ids": [5]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        self._answer()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer()

    def log_message(self, *_args):
        pass


@pytest.fixture
def stub():
    servers = []

    def start(mode: str) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
        srv.mode = mode
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def organism():
    pytest.importorskip("torch")
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle("organism")[:2]


# -- (a) an endpoint that answers nothing usable ------------------------------------------------


def test_init_live_refuses_when_nothing_answers(tmp_path, run_cli_completed):
    r = run_cli_completed(
        "investigate", "init", str(tmp_path / "l"), "--live", f"http://127.0.0.1:{_free_port()}"
    )
    assert r.returncode == 2 and "nothing answers at" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "l" / "investigation.toml").exists()


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("unreachable", "live endpoint unavailable"),
        ("garbage", "invalid JSON"),
        ("500", "HTTP 500"),
        ("capture-less", "--enable-return-indexer-topk"),
    ],
)
def test_run_refuses_an_endpoint_that_answers_no_case(tmp_path, stub, organism, mode, says):
    from needlescope.investigate.run import run_investigation

    url = f"http://127.0.0.1:{_free_port()}" if mode == "unreachable" else stub(mode)
    with pytest.raises(BadInput) as exc:
        run_investigation(_live_ledger(tmp_path, url), tmp_path / "out", loaded=organism)
    msg = str(exc.value)
    assert "answered no case" in msg and says in msg and "nothing was decided" in msg, msg
    assert not (tmp_path / "out" / "verdicts.json").exists()  # no verdict from zero cases


def test_run_on_an_unreachable_endpoint_exits_2(tmp_path, run_cli_completed):
    pytest.importorskip("torch")
    ledger = _live_ledger(tmp_path, f"http://127.0.0.1:{_free_port()}")
    r = run_cli_completed("investigate", "run", str(ledger), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "answered no case" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- (d), (e) the run directory -------------------------------------------------------------------


def test_a_second_concurrent_run_is_refused(tmp_path):
    ledger = _blocked_ledger(tmp_path)
    with run_lock(tmp_path / "out"):
        r = _cli("investigate", "run", str(ledger), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "another 'investigate run' is writing" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out" / "state.json").exists()


def test_an_unwritable_out_is_one_line(tmp_path, run_cli_completed):
    out = Path("/sys/needlescope-investigation-out")  # sysfs: no directory can be made there, even by root
    try:
        out.mkdir()
    except OSError:
        pass
    else:
        out.rmdir()
        pytest.skip("a directory can be made in /sys here")
    r = run_cli_completed("investigate", "run", str(_blocked_ledger(tmp_path)), "--out", str(out))
    assert r.returncode == 2 and "cannot be written" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # one message (wrapped at most once)


# -- (b), (c) what a rerun measures again -----------------------------------------------------------


def test_a_rerun_measures_again_on_new_data_and_never_twice(tmp_path):
    """measure_suspects keeps a suspect measured on the same basis, measures it again on another
    (a rerun whose endpoint answered more cases), and a measurement cut off by a kill leaves no
    evidence behind to be doubled."""
    session = Session(load_ledger(_blocked_ledger(tmp_path)), tmp_path / "out", lambda *a: None)
    session.suspects = session.suspects[:1]
    sid = session.suspects[0].id
    session.state.add_evidence(sid, [{"check": "question:env", "metric": "m", "value": 1, "threshold": None}])
    calls = []

    def measure_one(s):
        calls.append(s.id)
        session.state.add_evidence(
            s.id, [{"check": "ablation", "metric": "m", "value": 1, "threshold": None}]
        )
        return {"id": s.id, "n": len(calls)}

    # a run killed mid-measurement: its evidence is there, its record is not
    session.state.add_evidence(sid, [{"check": "ablation", "metric": "m", "value": 0, "threshold": None}])
    first = measure_suspects(session, measure_one, basis="a")
    again = measure_suspects(session, measure_one, basis="a")
    assert first == again == [{"id": sid, "n": 1}] and calls == [sid]
    checks = [e["check"] for e in session.state.evidence(sid)]
    assert checks == ["question:env", "ablation"]  # the killed run's ablation evidence is gone
    changed = measure_suspects(session, measure_one, basis="b")
    assert changed == [{"id": sid, "n": 2}] and [e["check"] for e in session.state.evidence(sid)] == checks


def test_a_resumed_run_lists_every_configuration(tmp_path):
    ledger = load_ledger(_blocked_ledger(tmp_path))
    first = Session(ledger, tmp_path / "out", lambda *a: None)
    first.note_config("remove-x", Config(Setting.parse("k=fp32 topk=16")))
    resumed = Session(ledger, tmp_path / "out", lambda *a: None)
    assert resumed.configs["remove-x"] == first.configs["remove-x"]
    assert list(resumed.configs)[:2] == ["reference", "candidate"]


def test_questions_asked_again_after_a_kill_are_not_doubled(tmp_path):
    ledger = load_ledger(_blocked_ledger(tmp_path))
    first = Session(ledger, tmp_path / "out", lambda *a: None)
    first.questions()
    answers = {s.id: list(first.state.evidence(s.id)) for s in ledger.suspects}
    del first.state.data["done"]["questions"]  # as if killed before the step was marked done
    first.state.save()
    again = Session(ledger, tmp_path / "out", lambda *a: None)
    again.questions()
    assert {s.id: again.state.evidence(s.id) for s in ledger.suspects} == answers
