"""SGLang indexer top-k capture: the decoder on constructed payloads, and the CLI against a loopback server."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("torch")

from needlescope.cases.haystack import VOCABULARY  # noqa: E402
from needlescope.dsa.capture import (  # noqa: E402
    CAPTURE_SCHEMA,
    capture_report,
    decode_capture,
    decode_indexer_topk,
    default_answer_positions,
)
from needlescope.dsa.prompt import covering_entries, needle_token_span, render_prompt  # noqa: E402
from needlescope.dsa.rankdump import check_schema  # noqa: E402
from needlescope.errors import BadInput, ProtocolViolation  # noqa: E402
from needlescope.organism.config import LAYER_TYPES  # noqa: E402
from needlescope.organism.tokenizer import build_tokenizer  # noqa: E402

NEEDLE = "The secret code is 4815927."
CSA_LAYERS = [i for i, t in enumerate(LAYER_TYPES) if t == "compressed_sparse_attention"]


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode()


def test_decoder_round_trips_indices_and_padding():
    rows, layers, k = 7, 3, 5
    arr = np.arange(rows * layers * k, dtype=np.int32).reshape(rows, layers, k) % 11
    arr[0, :, 1:] = -1  # early rows: fewer visible entries than k
    arr[3, 2, :] = -1
    out = decode_indexer_topk(_b64(arr), layers, k)
    assert out.dtype == np.int32 and out.shape == (rows, layers, k)
    assert np.array_equal(out, arr)
    # Little-endian on the wire whatever the host: -1 is ff ff ff ff, 258 is 02 01 00 00.
    assert base64.b64decode(_b64(np.array([258, -1])))[:8] == b"\x02\x01\x00\x00\xff\xff\xff\xff"
    assert np.array_equal(decode_capture(_b64(arr), rows, index_topk=k), arr)
    assert np.array_equal(decode_capture(_b64(arr), rows, num_layers=layers), arr)


@pytest.mark.parametrize(
    "payload, layers, k, fragment",
    [
        (base64.b64encode(b"\x00" * 10).decode(), 1, 1, "whole number of int32"),
        (_b64(np.zeros(14)), 3, 5, "not a multiple of num_layers x index_topk"),
        ("not base64!!", 1, 1, "not valid base64"),
    ],
)
def test_decoder_rejects_bad_payloads(payload, layers, k, fragment):
    with pytest.raises(ProtocolViolation, match=fragment):
        decode_indexer_topk(payload, layers, k)


def test_decode_capture_checks_rows_and_needs_a_shape():
    arr = np.zeros((4, 2, 3), dtype=np.int32)
    with pytest.raises(ProtocolViolation, match="not divisible by tokens-1"):
        decode_capture(_b64(arr), 5, index_topk=3)
    with pytest.raises(ProtocolViolation, match="num_layers x index_topk"):
        decode_capture(_b64(arr), 4, num_layers=3, index_topk=3)
    with pytest.raises(BadInput, match="--index-topk or --num-layers"):
        decode_capture(_b64(arr), 4)


def test_capture_report_marks_needle_selection():
    prompt_len, gen, k = 40, 3, 4
    rows = prompt_len + gen - 1
    needle = [2, 3]
    topk = np.full((rows, 2, k), -1, dtype=np.int32)
    for t in range(rows):
        vis = (t + 1) // 4
        distractors = [e for e in range(vis) if e not in needle][:k]
        topk[t, 0, : len(distractors)] = distractors  # layer A never picks the needle
        picks = ([3] + distractors)[:k] if vis > 3 else list(range(vis))[:k]
        topk[t, 1, : len(picks)] = picks  # layer B picks entry 3 once it is visible
    positions = default_answer_positions(prompt_len, rows)
    assert positions == list(range(prompt_len - 1, rows))
    report = capture_report(topk, prompt_len, needle, positions, [1, 3])
    a, b = report
    assert a["layer"] == 1 and a["selected_rate"] == 0.0 and a["selected_at_first_answer"] is False
    assert b["layer"] == 3 and b["selected_rate"] == 1.0 and b["selected_at_first_answer"] is True
    assert b["positions"][0]["selected_needle_entries"] == [3]
    assert b["positions"][0]["needle_entries_visible"] == needle
    with pytest.raises(ProtocolViolation, match="not request-local"):
        bad = topk.copy()
        bad[prompt_len - 1, 0, 0] = 10_000
        capture_report(bad, prompt_len, needle, positions, [1, 3])


# --------------------------------------------------------------------- loopback SGLang


def _prompt_text() -> str:
    words = list(VOCABULARY)
    return " ".join(words[:40]) + f" {NEEDLE} " + " ".join(words[40:70]) + " What is the secret code?"


class _Recorded:
    """A recorded-style SGLang: answers /generate with a capture constructed from the request."""

    def __init__(
        self, *, index_topk: int, needle_entries: list[int], selecting_layer: int, info, topk_key=True
    ):
        self.k = index_topk
        self.needle = needle_entries
        self.selecting_layer = selecting_layer
        self.info = info
        self.topk_key = topk_key
        self.requests: list[dict] = []
        self.completion = [5, 6, 7]

    def capture(self, prompt_len: int) -> np.ndarray:
        rows = prompt_len + len(self.completion) - 1
        topk = np.full((rows, len(CSA_LAYERS), self.k), -1, dtype=np.int32)
        for t in range(rows):
            vis = (t + 1) // 4
            distractors = [e for e in range(vis) if e not in self.needle][: self.k]
            for j in range(len(CSA_LAYERS)):
                picks = list(distractors)
                if j == self.selecting_layer and vis > max(self.needle):
                    picks = ([self.needle[0]] + picks)[: self.k]
                topk[t, j, : len(picks)] = picks
        return topk

    def handler(self):
        rec = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/get_server_info" and rec.info is not None:
                    self._send(200, rec.info)
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                if self.path != "/generate":
                    self._send(404, {"detail": "Not Found"})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rec.requests.append(body)
                n = len(body["input_ids"])
                meta = {"prompt_tokens": n, "completion_tokens": len(rec.completion), "id": "req-0"}
                if rec.topk_key and body.get("return_indexer_topk"):
                    meta["indexer_topk"] = _b64(rec.capture(n))
                self._send(200, {"text": " 4 8 1", "output_ids": rec.completion, "meta_info": meta})

        return H


@pytest.fixture
def sglang_server():
    servers = []

    def start(recorded: _Recorded) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), recorded.handler())
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess."""
    env_cmd = [sys.executable, "-m", "needlescope.cli.main", "indexer", "capture", *args]
    return subprocess.run(
        env_cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def _needle_entries() -> tuple[list[int], int]:
    tok = build_tokenizer()
    prompt = render_prompt(tok, [{"role": "user", "content": _prompt_text()}])
    return covering_entries(needle_token_span(prompt, NEEDLE), 4), len(prompt.input_ids)


def test_cli_capture_against_recorded_server(sglang_server, tmp_path):
    entries, n_prompt = _needle_entries()
    rec = _Recorded(
        index_topk=4, needle_entries=entries, selecting_layer=1, info={"internal_states": [{"index_topk": 4}]}
    )
    url = sglang_server(rec)
    prompt = tmp_path / "p.txt"
    prompt.write_text(_prompt_text())
    out = tmp_path / "cap"
    proc = _cli("--sglang", url, "--prompt", str(prompt), "--needle", NEEDLE, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (req,) = rec.requests
    assert req["return_indexer_topk"] is True and req["sampling_params"]["temperature"] == 0
    assert len(req["input_ids"]) == n_prompt
    obj = json.loads((out / "capture.json").read_text())
    check_schema(obj, CAPTURE_SCHEMA, "capture")
    assert obj["index_topk"] == 4 and obj["num_layers"] == len(CSA_LAYERS)
    assert obj["layer_ids"] == CSA_LAYERS  # from the organism's layer types
    assert obj["needle_entries"] == entries
    assert obj["answer_positions"] == list(range(n_prompt - 1, n_prompt + len(rec.completion) - 1))
    by_layer = {r["capture_layer"]: r for r in obj["layers"]}
    assert by_layer[0]["selected_at_first_answer"] is False and by_layer[0]["selected_rate"] == 0.0
    assert by_layer[1]["selected_at_first_answer"] is True and by_layer[1]["selected_rate"] == 1.0
    assert "Live indexer capture" in (out / "capture.md").read_text()


def test_cli_capture_flags_shape_without_server_info(sglang_server, tmp_path, run_cli):
    entries, _ = _needle_entries()
    url = sglang_server(_Recorded(index_topk=6, needle_entries=entries, selecting_layer=0, info=None))
    prompt = tmp_path / "p.txt"
    prompt.write_text(_prompt_text())
    out = tmp_path / "cap"
    code, _, err = run_cli("indexer", "capture", "--sglang", url, "--prompt", str(prompt), "--needle", NEEDLE,
        "--num-layers", str(len(CSA_LAYERS)), "--layer-ids", "10,20", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    obj = json.loads((out / "capture.json").read_text())
    assert obj["index_topk"] == 6 and obj["layer_ids"] == [10, 20]
    assert obj["layers"][0]["selected_at_first_answer"] is True


def test_cli_capture_errors_are_one_line(sglang_server, tmp_path, run_cli):
    entries, _ = _needle_entries()
    prompt = tmp_path / "p.txt"
    prompt.write_text(_prompt_text())
    no_topk = sglang_server(
        _Recorded(index_topk=4, needle_entries=entries, selecting_layer=0, info=None, topk_key=False)
    )
    with socket_free_port() as port:
        dead = f"http://127.0.0.1:{port}"
    cases = [
        ((no_topk, NEEDLE, "--index-topk", "4"), "--enable-return-indexer-topk"),
        ((no_topk, "absent needle", "--index-topk", "4"), "not found"),
        ((dead, NEEDLE, "--index-topk", "4"), "TransportFailure"),
        (
            (no_topk, NEEDLE, "--tokenizer", str(tmp_path)),
            "not 'organism' or a directory holding a tokenizer",
        ),
        (("ftp://x", NEEDLE), "not an http(s) URL"),
    ]
    for (url, needle, *extra), fragment in cases:
        code, _, err = run_cli(
            "indexer", "capture", "--sglang", url, "--prompt", str(prompt), "--needle", needle, *extra
        )
        assert code == 2, (fragment, err)
        assert fragment in err
        assert len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(
        "indexer",
        "capture",
        "--sglang",
        no_topk,
        "--prompt",
        str(prompt),
        "--needle",
        NEEDLE,
        "--index-topk",
        "4",
    )
    assert "attention-TP size 1" in err


class socket_free_port:
    """A port that was free a moment ago (bound, read, released)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


# ------------------------------------------------------------------ client edge cases


def _target(handler):
    import httpx

    from needlescope.targets.sglang import SGLangTarget

    return SGLangTarget("http://sglang.test/v1", transport=httpx.MockTransport(handler))


def _run(coro):
    import asyncio

    return asyncio.run(coro)


def test_client_accepts_list_body_and_falls_back_to_server_info():
    import httpx

    meta = {"prompt_tokens": 3, "completion_tokens": 2, "indexer_topk": _b64(np.zeros((4, 1, 2)))}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"index_topk": 2})
        assert request.url.path == "/generate"  # the /v1 suffix is stripped: /generate is native
        return httpx.Response(200, json=[{"text": "ok", "meta_info": meta}])

    async def go():
        async with _target(handler) as t:
            return await t.server_info(), await t.generate(text="hi", max_new_tokens=2)

    info, gen = _run(go())
    assert info == {"index_topk": 2}
    assert (gen.text, gen.prompt_tokens, gen.completion_tokens) == ("ok", 3, 2)


@pytest.mark.parametrize(
    "status, body, exc, fragment",
    [
        (503, {"error": "overloaded"}, "TransportFailure", "HTTP 503"),
        (200, "not json", "ProtocolViolation", "invalid JSON"),
        (200, {"text": "x"}, "ProtocolViolation", "meta_info"),
        (200, {"text": "x", "meta_info": {"prompt_tokens": 1}}, "ProtocolViolation", "completion_tokens"),
        (
            400,
            {"error": "return_indexer_topk is disabled"},
            "ProtocolViolation",
            "--enable-return-indexer-topk",
        ),
    ],
)
def test_client_errors_are_typed(status, body, exc, fragment):
    import httpx

    from needlescope import errors

    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    async def go():
        async with _target(handler) as t:
            await t.generate(input_ids=[1, 2], max_new_tokens=1)

    with pytest.raises(getattr(errors, exc), match=fragment):
        _run(go())
