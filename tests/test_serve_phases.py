"""``needlescope serve`` under issue 38's reliability findings: every phase of a connection has a
deadline (R1 stalled bodies, R20 half-closed clients), SIGTERM answers running requests (R5),
unknown fields are logged in summary (R4), tiny sampling values are served (R10), the patch is
shown by name (R16, item 12), and the command's bad input is one line and exit 2 (item 11, R18).

A real server child on loopback, with a test patch that makes every forward pass sleep, so a
request runs long enough to meet a deadline or a SIGTERM; raw sockets and httpx as callers.
Each test failed on the code before its fix (the docstrings say how)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from needlescope.serve.app import SHUTDOWN_GRACE_S
from needlescope.serve.launch import SERVE_ARGV, ChildServer
from needlescope.testing.checkpoints import TINY_SERVE, save_random

NAME = "tiny"
MAX_CONNECTIONS = 64
BODY_TIMEOUT = 3.0
HALF_CLOSE_TIMEOUT = 1.5
STEP_S = 0.05
SLOW_PATCH = f'''"""Test patch: every forward pass of the model sleeps {STEP_S} s (a slow decode)."""
import time


def apply(model):
    return model.register_forward_pre_hook(lambda module, args: time.sleep({STEP_S})).remove
'''


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("ckpt"), seed=3, **TINY_SERVE)


@pytest.fixture(scope="module")
def slow_patch(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("patches") / "slow_steps.py"
    path.write_text(SLOW_PATCH)
    return path


def _argv(ckpt: Path, patch: Path, *flags: str) -> list[str]:
    return [
        *SERVE_ARGV,
        *("--model", str(ckpt), "--port", "0", "--served-model-name", NAME, "--patch", str(patch)),
        *flags,
    ]


@pytest.fixture(scope="module")
def server(ckpt, slow_patch):
    flags = ["--max-connections", str(MAX_CONNECTIONS), "--body-timeout", str(BODY_TIMEOUT)]
    flags += ["--half-close-timeout", str(HALF_CLOSE_TIMEOUT), "--max-running-requests", "2"]
    with ChildServer(_argv(ckpt, slow_patch, *flags), health_path="/health") as srv:
        yield srv


def chat_body(**kw) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **kw}


def raw_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def chat_count(server, status: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("needlescope_serve_requests_total{") and 'endpoint="/v1/chat/completions"' in line:
            if f'status="{status}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- R1: a flood of complete heads with no body ------------------------------------------------


def test_stalled_bodies_never_take_health_off_the_air(server):
    """300 connections each send a complete POST head with a Content-Length and no body, against
    a cap of 64 connections: /health answers every poll, and the stalled connections are closed
    by the body deadline. Before the fix a head-complete connection counted as busy, the cap
    evicted none of them and refused every new connection: /health got nothing until the body
    deadline, and a flood that reconnects keeps it off the air for good."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 200\r\n\r\n"
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(head)
            socks.append(s)
        answers = []
        for _ in range(5):
            try:
                answers.append(httpx.get(server.url + "/health", timeout=5).status_code)
            except httpx.HTTPError as e:
                answers.append(type(e).__name__)
        assert answers == [200] * 5, answers
        # The newest stalled connection was never evicted: the body deadline closes it.
        last = socks[-1]
        last.settimeout(BODY_TIMEOUT + 10)
        assert read_to_end(last) == b"", "a stalled body got an answer instead of being closed"
    finally:
        for s in socks:
            s.close()
    log = server.stderr
    assert log.count(f"connection cap of {MAX_CONNECTIONS} reached") <= 2, log[-2000:]
    assert "no complete request body" in log and "Traceback" not in log, log[-2000:]


def test_a_request_being_answered_is_never_evicted(server):
    """A kept-alive connection's second request, sent whole in one write, is being answered when
    a flood of stalled bodies fills the cap: the cap evicts the flood, never that request."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n"
    with httpx.Client(base_url=server.url, timeout=60) as client, cf.ThreadPoolExecutor(1) as pool:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        slow = pool.submit(
            client.post, "/v1/chat/completions", json=chat_body(max_tokens=30, ignore_eos=True)
        )
        _wait_running(server, 1)
        socks = [
            socket.create_connection(("127.0.0.1", server.port), timeout=5)
            for _ in range(2 * MAX_CONNECTIONS)
        ]
        try:
            for s in socks:
                s.sendall(head)
            answer = slow.result()
        finally:
            for s in socks:
                s.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 30


# ---- R20: a client that half-closes after its request -------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_after_its_request_gets_its_answer(server, stream):
    """The request is sent whole, then the client shuts down its sending side (FIN) and reads:
    it gets the complete answer, and the 200 the server counts is the one it delivered. Before
    the fix the server closed the connection at the FIN, answered nothing, and counted a 200."""
    before = chat_count(server, "200")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(raw_request(chat_body(stream=stream)))
        s.shutdown(socket.SHUT_WR)
        answer = read_to_end(s)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    if stream:
        assert answer.rstrip().endswith(b"0") and b"data: [DONE]" in answer, answer[-300:]
    else:
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["choices"][0]["finish_reason"] == "length", body
    assert chat_count(server, "200") == before + 1


def test_a_half_closed_client_is_not_waited_on_past_its_deadline(server):
    """A half-closed client whose answer takes longer than --half-close-timeout: its connection
    is closed at the deadline, the request is cancelled and counted as a client that left (499),
    never as a 200 it did not get."""
    before = (chat_count(server, "200"), chat_count(server, "499"))
    slow = chat_body(max_tokens=200, ignore_eos=True)  # 200 steps of STEP_S: far past the deadline
    with socket.create_connection(("127.0.0.1", server.port), timeout=HALF_CLOSE_TIMEOUT + 20) as s:
        s.sendall(raw_request(slow))
        s.shutdown(socket.SHUT_WR)
        assert read_to_end(s) == b""
    deadline = time.monotonic() + 10  # the request notices its client left within a poll
    while chat_count(server, "499") == before[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (chat_count(server, "200"), chat_count(server, "499")) == (before[0], before[1] + 1)
    assert "could not be answered within" in server.stderr


# ---- R4, R10, R16 and item 12 ---------------------------------------------------------------------


def test_unknown_fields_are_logged_in_summary_not_in_full(server):
    """20 requests, each with 2,000 unknown fields of 100-character names: at most one log line
    per request model, naming a few fields. Before: every request logged every name in full
    (about 200 kB of log per request)."""
    before = len(server.stderr)
    body = chat_body(max_tokens=1, **{f"vendor_{i:04d}_" + "x" * 88: i for i in range(2000)})
    with httpx.Client(timeout=60) as c:
        codes = {c.post(server.url + "/v1/chat/completions", json=body).status_code for _ in range(20)}
    assert codes == {200}
    time.sleep(0.5)  # let the drain thread read the last lines
    log = server.stderr[before:]
    lines = [line for line in log.splitlines() if "ignoring unknown fields" in line]
    assert len(lines) == 1, log[:3000]
    assert "and 1992 more" in lines[0] and len(log) < 2000, lines[0][:500]


@pytest.mark.parametrize("params", [{"top_p": 1e-300}, {"repetition_penalty": 1e-40}])
def test_tiny_in_range_sampling_values_are_served(server, params):
    """Before the fix: top_p 1e-300 (0 in float32) dropped every token and repetition_penalty
    1e-40 overflowed the logits to inf; both gave HTTP 500 and a logged traceback."""
    r = httpx.post(
        server.url + "/v1/chat/completions", json=chat_body(temperature=1.0, seed=1, **params), timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in server.stderr


def test_the_patch_is_shown_by_name_never_by_its_path(server, slow_patch):
    """/get_server_info and the startup line name the patch file without its directory (R16: it
    showed the absolute path; item 12: the startup line did not show the patch at all)."""
    info = httpx.get(server.url + "/get_server_info", timeout=10).json()
    assert info["patch"] == info["args"]["patch"] == slow_patch.name
    assert str(slow_patch.parent) not in json.dumps(info)
    banner = server.stderr.split("\n\n")[0].replace("\n", " ")
    assert f"patch={slow_patch.name}" in banner and str(slow_patch.parent) not in server.stderr


# ---- R5: SIGTERM with requests still running ------------------------------------------------------


def _wait_running(srv: ChildServer, n: int) -> None:
    deadline = time.monotonic() + 30
    while f"needlescope_serve_running_requests {n}.0" not in httpx.get(srv.url + "/metrics").text:
        assert time.monotonic() < deadline, f"never {n} running"
        time.sleep(0.05)


def test_sigterm_answers_requests_still_running_after_the_grace_period(server):
    """Two requests run in one batch (a plain one and a stream, each ~20 s of decoding) when the
    server gets SIGTERM: after the grace period the plain one gets a JSON 503 shutting_down and
    the stream an error event, then the end of the stream. Before the fix neither got anything:
    their connections dropped when the process exited, 18-21 s later.

    It ends the module's server (its limits do not touch these two requests; starting a second
    server cost seconds of imports and a model load), so it is the file's last test to use it."""
    srv = server
    long = chat_body(max_tokens=400, ignore_eos=True)

    def plain():
        return httpx.post(srv.url + "/v1/chat/completions", json=long, timeout=60)

    def stream():
        with httpx.stream(
            "POST", srv.url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60
        ) as r:
            return r.status_code, [line for line in r.iter_lines() if line]

    with cf.ThreadPoolExecutor(3) as pool:
        # A short request first: while it runs, the two long ones wait and then batch together.
        blocker = pool.submit(
            httpx.post, srv.url + "/v1/chat/completions", json=chat_body(max_tokens=20), timeout=60
        )
        _wait_running(srv, 1)
        answers = [pool.submit(plain), pool.submit(stream)]
        assert blocker.result().status_code == 200
        _wait_running(srv, 2)
        srv.proc.send_signal(signal.SIGTERM)
        plain_resp, (stream_status, events) = (f.result() for f in answers)
        srv.proc.wait(timeout=30)
    assert plain_resp.status_code == 503, plain_resp.text
    assert plain_resp.json()["error"]["code"] == "shutting_down"
    assert stream_status == 200
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "shutting_down" and events[-1] == "data: [DONE]", events[-3:]
    assert f"2 request(s) still running after {SHUTDOWN_GRACE_S:g}s" in srv.stderr, srv.stderr[-2000:]


# ---- item 11, R18: bad input to the command -------------------------------------------------------


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE_ARGV, *args], capture_output=True, text=True, timeout=300)


def _one_line_exit_2(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_busy_port_is_one_line_and_exit_2_before_the_model_loads(tmp_path):
    """The model directory does not exist, so only a server that binds before loading reports the
    port. Before the fix: the model loaded, then uvicorn printed [Errno 98] and it exited 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve("--model", str(tmp_path / "nowhere"), "--port", str(port))
    _one_line_exit_2(done, f"127.0.0.1:{port}", "in use", "--port")


@pytest.mark.parametrize("key, what", [("sk-kéy-0123", "non-ASCII"), ("sk-one\nsk-two", "control character")])
def test_an_api_key_no_header_can_carry_is_one_line_and_exit_2(
    tmp_path, key, what, monkeypatch, run_cli_completed
):
    """Before the fix a non-ASCII key gave a traceback and a key with a newline exited 1. The
    entry point in this process (the busy-port test above runs the command as a child)."""
    monkeypatch.setenv("NEEDLESCOPE_API_KEY", key)
    done = run_cli_completed("serve", "--model", str(tmp_path / "nowhere"), "--port", "0")
    _one_line_exit_2(done, what, "--api-key")
    assert key not in done.stderr


@pytest.mark.parametrize(
    "source, where",
    [
        (
            "raise BaseException('not an Exception')\n\ndef apply(model):\n    return None\n",
            "failed to import",
        ),
        ("def apply(model):\n    raise BaseException('not an Exception')\n", "apply(model) failed"),
    ],
)
def test_a_patch_raising_baseexception_is_bad_input(tmp_path, source, where):
    """A patch file that raises BaseException (not an Exception) at import or in apply(model):
    before the fix it escaped as itself and ended serve (and every command applying patches)
    with a traceback; now it is BadInput, which the CLI prints as one line with exit 2."""
    import torch

    from needlescope.dsa.emulate import apply_patch_once
    from needlescope.errors import BadInput

    bad = tmp_path / "raises_base.py"
    bad.write_text(source)
    with pytest.raises(BadInput, match="BaseException: not an Exception") as info:
        apply_patch_once(torch.nn.Linear(2, 2), bad)
    assert where in str(info.value)
