"""Client-side regressions found by driving probe, compare, replay, health and canary against
peers that answer like vLLM or SGLang with a difference (an echoed key, content that is not
text, a tokenize endpoint that does not count, a server that dies while cases are counted).

Each peer is a real HTTP server on 127.0.0.1 (stdlib, in a thread); the client runs unchanged.
Its answers come from the scripted server's rules (``testing.scripted_server.answer``), so every
needle it is asked for is recalled unless the mode says otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from needlescope.testing.scripted_server import answer, render_words
from needlescope.testing.servers import JsonHandler, in_thread

KEY = "sk-outsider-7f3a9c21e4"
MODEL = "peer"
CONTEXT = 4096
GRID = ["--kind", "single", "--lengths", "200,300", "--depths", "0,100", "--trials", "1"]
CLI = [sys.executable, "-m", "needlescope.cli.main"]


def peer(
    mode: str = "",
    *,
    key: str | None = None,
    slow_chat_s: float = 0.0,
    tokenize_ok: int = 0,
    slow_info_s: float = 0.0,
):
    """A handler class for ``in_thread``: an OpenAI-compatible peer in ``mode``.

    Modes (only needle chats, ``max_tokens`` > 1, are changed; the preflight's one-token chat
    is answered normally): ``echo_key`` answers 400 quoting the request's Authorization header;
    ``content_int`` gives ``content: 123``; ``content_parts`` gives the answer as a list of text
    parts and ``prompt_tokens: true``; ``stream_int`` streams (when asked to) a delta whose
    content is 7; ``wrong`` answers 000; ``tok_const`` counts every chat as
    50 tokens; ``tokenize_drops`` drops the connection of every ``/tokenize`` after the first
    ``tokenize_ok``. ``key``: every route but /health needs it. ``slow_chat_s``: each needle
    chat waits this long first. ``slow_info_s``: ``/get_server_info`` waits this long first."""
    seen = {"tokenize": 0, "needle_chats": 0}
    lock = threading.Lock()

    class Handler(JsonHandler):
        def _authorized(self) -> bool:
            if key is None or self.path == "/health" or self.headers.get("Authorization") == f"Bearer {key}":
                return True
            self._send(401, {"error": {"message": "wrong API key"}})
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif self.path == "/get_server_info":
                time.sleep(slow_info_s)
                self._send(200, {"context_length": CONTEXT, "trained_value_digits": 4})
            elif self.path == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not self._authorized():
                return
            if self.path == "/tokenize":
                with lock:
                    seen["tokenize"] += 1
                    n = seen["tokenize"]
                if mode == "tokenize_drops" and n > tokenize_ok:
                    self.close_connection = True
                    self.connection.shutdown(2)  # no answer: the server died mid-count
                    return
                count = 50 if mode == "tok_const" else len(render_words(body.get("messages", [])))
                self._send(200, {"count": count})
            elif self.path == "/v1/chat/completions":
                self._chat(body)
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def _chat(self, body: dict) -> None:
            needle = (body.get("max_tokens") or 0) > 1
            if needle:
                with lock:
                    seen["needle_chats"] += 1
            if needle and slow_chat_s:
                time.sleep(slow_chat_s)
            if needle and mode == "echo_key":
                auth = self.headers.get("Authorization")
                self._send(400, {"error": {"message": f"rejected header Authorization: {auth}"}})
                return
            text = answer(body["messages"], window=100_000)
            if needle and body.get("stream") and mode == "stream_int":
                self._stream_int()
                return
            content: object = text
            usage: dict = {"prompt_tokens": len(render_words(body["messages"])), "completion_tokens": 1}
            if needle and mode == "content_int":
                content = 123
            elif needle and mode == "content_parts":
                content = [{"type": "text", "text": text}]
                usage["prompt_tokens"] = True
            elif needle and mode == "wrong":
                content = "000"
            message = {"role": "assistant", "content": content}
            self._send(
                200,
                {
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": usage,
                },
            )

        def _stream_int(self) -> None:
            chunks = [
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": 7}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            ]
            data = (
                b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            )
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    Handler.seen = seen  # what it was asked: tests wait on it instead of reading a store being written
    return Handler


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _files_holding(root: Path, text: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_a_key_the_server_echoes_never_reaches_results_or_the_console(run_cli, tmp_path):
    """A peer that quotes the request's Authorization header in its error: before, the key was
    written to results.jsonl and results.sqlite and printed by health and canary."""
    with in_thread(peer("echo_key")) as url:
        out = tmp_path / "run"
        code, stdout, stderr = run_cli(
            "probe", "--base-url", url + "/v1", "--model", MODEL, *GRID, "--out", str(out), "--api-key", KEY
        )
        assert code == 1, stderr  # every needle chat failed: cells without data
        rows = _rows(out)
        assert rows and all(r["status"] == "error" and r["error_kind"] == "protocol" for r in rows)
        # What the server said is kept, without the key in it.
        assert all("rejected header Authorization: Bearer [api key redacted]" in r["error"] for r in rows)
        assert _files_holding(tmp_path, KEY) == []
        assert KEY not in stdout + stderr

        code, stdout, stderr = run_cli("health", "--base-url", url, "--api-key", KEY, "--length", "200")
        assert code == 1
        assert "[api key redacted]" in stdout
        assert KEY not in stdout + stderr


def test_content_that_is_not_text_is_a_protocol_error_never_a_miss(run_cli, tmp_path):
    """``content: 123`` was scored as the answer '123' (a miss, near_miss); a list of text parts
    was scored against its Python repr; ``prompt_tokens: true`` was read as a count of 1."""

    def probe(mode: str, want_code: int) -> list[dict]:
        with in_thread(peer(mode)) as url:
            out = tmp_path / mode
            code, _, stderr = run_cli("probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(out))
        assert code == want_code, stderr
        rows = _rows(out)
        assert len(rows) == 4
        return rows

    rows = probe("content_int", 1)
    assert all(r["status"] == "error" and r["error_kind"] == "protocol" for r in rows)
    assert all(r["correct"] is None for r in rows)
    assert "not text" in rows[0]["error"]
    for r in probe("content_parts", 0):
        assert r["status"] == "ok" and r["correct"] == 1
        assert r["answer"] == ", ".join(r["expected"])  # the joined text, not a repr
        assert r["prompt_tokens"] is None  # true is not a token count


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--retry-budget", "nan"], "--retry-budget must be zero or more seconds; got nan"),
        (["--retry-budget", "inf"], "--retry-budget must be zero or more seconds; got inf"),
        (["--timeout", "inf"], "--timeout must be a positive number of seconds; got inf"),
    ],
)
def test_a_budget_or_timeout_without_end_is_bad_input(run_cli, tmp_path, flags, message):
    """``--retry-budget nan`` was accepted, and a server answering 429 for ever was retried for
    ever (``elapsed + delay > nan`` is never true)."""
    code, _, stderr = run_cli(
        "probe",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        MODEL,
        *GRID,
        "--out",
        str(tmp_path),
        *flags,
    )
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr


def test_max_tokens_beyond_the_context_says_so(run_cli, tmp_path):
    """Before: 'pass lengths up to -904' (a context of 4096 less 5000 answer tokens)."""
    with in_thread(peer()) as url:
        code, _, stderr = run_cli(
            "probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(tmp_path / "o"),
            "--max-tokens", "5000",
        )  # fmt: skip
    assert code == 2
    assert "--max-tokens 5000 leaves no room for a prompt" in stderr
    assert "-904" not in stderr


def test_a_target_that_dies_while_cases_are_counted_is_one_line(run_cli, tmp_path):
    """The server's /tokenize answered the detection, then dropped every connection: before, a
    TransportFailure traceback (exit 1)."""
    out = tmp_path / "run"
    with in_thread(peer("tokenize_drops", tokenize_ok=3)) as url:
        code, _, stderr = run_cli("probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(out))
    assert code == 2
    assert "Traceback" not in stderr
    assert "the target failed while counting the cases' tokens" in stderr
    assert not (out / "results.sqlite").exists()


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, env=env)


def test_a_count_that_does_not_grow_with_the_text_is_refused(tmp_path):
    """A tokenize endpoint that counts every chat alike, or a chat template that leaves out the
    content: the fitter doubled the filler for ever (the probe hung). A child with a timeout, so
    a regression fails instead of hanging the suite."""
    with in_thread(peer("tok_const")) as url:
        res = _cli("probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(tmp_path / "a"))
    assert res.returncode == 2, res.stderr
    assert "does not count the messages' text" in res.stderr

    weights = Path(__file__).resolve().parents[1] / "src/needlescope/organism/weights"
    template = tmp_path / "roles.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with in_thread(peer()) as url:
        res = _cli(
            "probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(tmp_path / "b"),
            "--tokenizer", str(weights / "tokenizer.json"), "--chat-template", str(template),
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert f"the chat template {template} counts" in res.stderr


def test_health_and_canary_call_bad_usage_bad_usage_not_unhealthy(run_cli, tmp_path):
    """A --length too short for the needle, or a --tokenizer folder without tokenizer.json, made
    health report the deployment UNHEALTHY (exit 1) and the canary warn every round for ever."""
    with in_thread(peer()) as url:
        code, stdout, stderr = run_cli("health", "--base-url", url, "--length", "10")
        assert code == 2, stdout
        assert "shorter than the needle" in stderr
        code, stdout, stderr = run_cli("health", "--base-url", url, "--tokenizer", str(tmp_path))
        assert code == 2, stdout
        assert "no tokenizer.json" in stderr
        code, stdout, stderr = run_cli("health", "--base-url", url, "--length", "200")
        assert code == 0, stdout  # the control: the same peer is healthy
        for flags in (["--lengths", "10"], ["--lengths", "200", "--tokenizer", str(tmp_path)]):
            code, _, stderr = run_cli(
                "canary", "--base-url", url, "--depths", "50", "--interval", "1", "--rounds", "3",
                "--listen", "127.0.0.1:0", *flags,
            )  # fmt: skip
            assert code == 2, stderr
            assert "error:" in stderr


def _results(store: Path) -> int:
    with closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:  # read only, and closed
        return db.execute("select count(*) from results").fetchone()[0]


def _store_state(store: Path, seen: dict) -> str:
    """What a store holds, read only, once its writer has ended (a flake's evidence)."""
    if not store.is_file():
        return f"; no {store}; peer saw {seen}"
    with closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
        cases, results = (db.execute(f"select count(*) from {t}").fetchone()[0] for t in ("cases", "results"))
    return f"; {store}: {cases} cases, {results} results; peer saw {seen}"


def _kill_when(argv: list[str], ready, explain=lambda: "") -> None:
    """Run the CLI with ``argv`` in a child and SIGKILL it once ``ready()`` holds (within 90 s);
    the child must still be running then (else the failure adds ``explain()``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([*CLI, *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and child.poll() is None and not ready():
            time.sleep(0.05)
        assert child.poll() is None, child.stderr.read().decode() + explain()
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stderr.close()


def test_compare_killed_while_probing_b_resumes(run_cli, tmp_path):
    """SIGKILL while side B runs: A's report files were written but recorded in the folder's
    manifest only when the command ended, so ``--resume`` refused them as not needlescope's
    ('a/heatmap.png was not written by needlescope')."""
    out = tmp_path / "ab"
    slow = peer(slow_chat_s=0.4)
    with in_thread(peer()) as a, in_thread(slow) as b:
        argv = [
            "compare", "--a", a, "--b", b, "--model", MODEL, "--kind", "single", "--lengths", "200,300",
            "--depths", "0,50,100", "--trials", "2", "--concurrency", "1", "--out", str(out),
        ]  # fmt: skip
        b_store = out / "b" / "results.sqlite"
        # Ready once B has been asked a third needle chat (two recorded), counted by the peer: the
        # store is not opened while the child writes it.
        _kill_when(argv, lambda: slow.seen["needle_chats"] >= 3, lambda: _store_state(b_store, slow.seen))
        done_before = _results(b_store)
        assert 2 <= done_before < 12
        assert (out / "a" / "heatmap.png").is_file()  # A had finished and written its report

        code, stdout, stderr = run_cli(*argv, "--resume")
    assert code == 0, stderr
    pairs = (out / "pairs.jsonl").read_text().splitlines()
    assert len(pairs) == 12
    assert len({json.loads(p)["case_id"] for p in pairs}) == 12
    assert _results(out / "b" / "results.sqlite") == 12


def test_compare_killed_while_b_is_set_up_resumes(run_cli, tmp_path):
    """SIGKILL after A finished, while B's store was being set up (B's server info is slow): the
    store had its fingerprint and no cases, and ``--resume`` refused it. B's store is now built
    aside and renamed into place."""
    out = tmp_path / "ab"
    with in_thread(peer()) as a, in_thread(peer(slow_info_s=2.0)) as b:
        argv = ["compare", "--a", a, "--b", b, "--model", MODEL, *GRID, "--out", str(out)]
        b = out / "b"
        _kill_when(argv, lambda: b.is_dir() and any(p.name.startswith("results.sqlite") for p in b.iterdir()))
        assert not (out / "b" / "pairs.jsonl").exists()
        code, _, stderr = run_cli(*argv, "--resume")
    assert code == 0, stderr
    assert len((out / "pairs.jsonl").read_text().splitlines()) == 4
    assert _results(out / "b" / "results.sqlite") == 4
    assert not list((out / "b").glob("*.partial*"))


def test_replay_takes_api_key(run_cli, tmp_path):
    """``replay`` read the key only from the environment: ``--api-key`` was 'No such option'."""
    out = tmp_path / "run"
    with in_thread(peer("wrong", key=KEY)) as url:
        code, _, stderr = run_cli(
            "probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(out), "--api-key", KEY
        )
        assert code == 0, stderr
        bundles = sorted((out / "bundles").iterdir())
        assert bundles
        code, stdout, stderr = run_cli("replay", str(bundles[0]), "--base-url", url, "--api-key", KEY)
    assert code == 0, stderr
    assert "reproduced 1/1 times" in stdout
    assert _files_holding(tmp_path, KEY) == []


def test_a_streamed_delta_that_is_not_text_is_a_protocol_error_not_a_crash(run_cli, caplog):
    """The canary streams; a chunk whose ``delta.content`` was a number ended the whole canary
    with a TypeError traceback (``"".join`` of the deltas)."""
    with in_thread(peer("stream_int")) as url:
        code, _, stderr = run_cli(
            "canary", "--base-url", url, "--lengths", "200", "--depths", "50", "--interval", "1",
            "--rounds", "1", "--listen", "127.0.0.1:0",
        )  # fmt: skip
    assert code == 1  # a bounded run that scored nothing
    logged = caplog.text + stderr
    assert "probe error (protocol)" in logged
    assert "content that is not text" in logged
    assert "Traceback" not in logged


@pytest.mark.parametrize(
    "argv",
    [
        ["oracle", "export", "--out", "{out}"],  # no --model: the list is read first
        ["engine-state", "--model", MODEL, "--out", "{out}"],
        ["serving-factors", "--model", MODEL, "--out", "{out}"],
    ],
)
def test_a_server_nothing_answers_at_is_named_unreachable(run_cli, tmp_path, argv):
    """Before: oracle export said the server 'lists no model at /v1/models; pass --model', and
    engine-state that it 'has a tokenize endpoint but it failed'; both blamed a server that
    was not there."""
    with in_thread(peer()) as url:
        pass  # the port was just served and is closed now: nothing answers there
    argv = [a.format(out=tmp_path / "o") for a in argv]
    code, _, stderr = run_cli(*argv, "--base-url", url)
    assert code == 2
    assert "cannot reach" in stderr and "Traceback" not in stderr, stderr
    assert "lists no model" not in stderr and "tokenize endpoint but it failed" not in stderr


KILLED_IN_ADD_CASES = """\
import os, signal, sys
from needlescope.run import store
def killed(self, cases):  # SIGKILL in the window between the store's identity and its cases
    os.kill(os.getpid(), signal.SIGKILL)
store.ResultStore.add_cases = killed
from needlescope.cli.main import main
sys.exit(main())
"""


def test_a_probe_killed_while_its_store_is_built_starts_again_cleanly(run_cli, tmp_path):
    """SIGKILL after the fingerprint was written and before the cases were: the store had an
    identity and no cases, so a fresh run said 'already holds a run; pass --resume' and
    ``--resume`` said 'holds no cases; delete it'. The store is now built aside and renamed."""
    out = tmp_path / "run"
    with in_thread(peer()) as url:
        argv = ["probe", "--base-url", url, "--model", MODEL, *GRID, "--out", str(out)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        child = subprocess.run(
            [sys.executable, "-c", KILLED_IN_ADD_CASES, *argv], env=env, capture_output=True
        )
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()
        assert not (out / "results.sqlite").exists()
        code, _, stderr = run_cli(*argv)
    assert code == 0, stderr
    assert _results(out / "results.sqlite") == 4
    assert not list(out.glob("*.partial*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["health", "--base-url", "http://bob:s3cret-pw@127.0.0.1:9/v1"],
        ["probe", "--base-url", "http://bob:s3cret-pw@127.0.0.1:9/v1", "--model", MODEL],
        [
            "compare",
            "--a",
            "http://bob:s3cret-pw@127.0.0.1:9",
            "--b",
            "http://127.0.0.1:9/v1",
            "--model",
            MODEL,
        ],
    ],
)
def test_credentials_in_the_url_are_refused_without_being_printed(run_cli, tmp_path, argv):
    """``http://user:pass@host`` was taken as given and printed in health's output, the canary's
    log and the results' provenance: a credential in logs and artifacts."""
    code, stdout, stderr = run_cli(*argv, *(["--out", str(tmp_path / "o")] if argv[0] != "health" else []))
    assert code == 2, stdout + stderr
    assert "carries credentials" in stderr and "--api-key" in stderr
    assert "s3cret-pw" not in stdout + stderr
    assert not (tmp_path / "o").exists()
