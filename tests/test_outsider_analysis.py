"""Regressions found by driving ``oracle``, ``replay`` and ``probe --bisect`` as an outsider would:
peers that write logprobs the way real engines do (vLLM's -9999.0 for -inf, a literal -Infinity,
top_logprobs in the chat shape), hand-edited exports, hostile bundles, and a target that fails
every request at one length.

Each peer is a real HTTP server on 127.0.0.1 (stdlib, in a thread); the CLI runs in-process
through its real entry point (``run_cli``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from needlescope.testing.scripted_server import answer, needle_depth, render_words
from needlescope.testing.servers import JsonHandler, in_thread

MODEL = "peer"


def oracle_peer(top: str):
    """A completions peer that answers every prompt greedily with the tokens a, b, c and, per
    position, three alternatives whose last is impossible; ``top`` is how it writes them:
    ``inf`` (a literal -Infinity, as Python's json writes it), ``vllm`` (-9999.0, vLLM's stand-in
    for -inf) or ``chat_shape`` (a list of {"token", "logprob"}, as in chat completions);
    ``finite`` gives the third alternative -3.0 (possible)."""

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self._send(200, {"tokens": [len(w) for w in body["prompt"].split()]})
                return
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            toks = ["a", "b", "c"][: body["max_tokens"]]
            never = {"inf": float("-inf"), "vllm": -9999.0, "chat_shape": float("-inf"), "finite": -3.0}[top]
            tops: list = [{t: -0.1, "zz": -2.5, "yy": never} for t in toks]
            if top == "chat_shape":
                tops = [[{"token": k, "logprob": v} for k, v in alts.items()] for alts in tops]
            lp = {"tokens": toks, "token_logprobs": [-0.1] * len(toks), "top_logprobs": tops}
            choice = {"index": 0, "text": "".join(toks), "finish_reason": "length", "logprobs": lp}
            self._send(
                200, {"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": len(toks)}}
            )

    return Handler


@pytest.fixture
def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.json"
    path.write_text(
        json.dumps(
            {
                "name": "outsider",
                "prompts": [
                    {"id": "p1", "category": "x", "prompt": "hello there world", "max_tokens": 3},
                    {"id": "p2", "category": "x", "prompt": "one two", "max_tokens": 2},
                ],
            }
        )
    )
    return str(path)


def _export(run_cli, url: str, out: Path, prompts: str) -> None:
    code, _out, err = run_cli(
        "oracle", "export", "--base-url", url + "/v1", "--out", str(out), "--prompts", prompts
    )
    assert code == 0, err


def test_an_impossible_token_written_as_minus_inf_or_vllms_minus_9999_is_no_difference(
    run_cli, tmp_path, prompts
):
    """Before: the same -Infinity on both sides made |Δ| = -inf - -inf = NaN, so a server compared
    with itself printed 'mean |Δ logprob| nan' and its verdict ('identical' or 'same_tokens')
    depended on set order; vLLM's -9999.0 against another engine's -inf (both: probability 0)
    was |Δ| = inf and 'same_tokens'."""
    with in_thread(oracle_peer("inf")) as inf, in_thread(oracle_peer("vllm")) as vllm:
        _export(run_cli, inf, tmp_path / "inf", prompts)
        _export(run_cli, vllm, tmp_path / "vllm", prompts)
        for ref, cand in (("inf", inf), ("vllm", inf)):
            code, out, err = run_cli(
                "oracle",
                "compare",
                str(tmp_path / ref),
                "--base-url",
                cand + "/v1",
                "--out",
                str(tmp_path / f"c-{ref}"),
            )
            assert code == 0, err
            assert "Verdict: **identical**" in out and "mean |Δ logprob| 0 (max 0)" in out, out
            summary = json.loads((tmp_path / f"c-{ref}" / "oracle.json").read_text())["summary"]
            assert (summary["verdict"], summary["max_abs_dlogprob"], summary["max_kl"]) == (
                "identical",
                0.0,
                0.0,
            )


def test_top_logprobs_in_the_chat_shape_are_read_not_a_traceback(run_cli, tmp_path, prompts):
    """Before: a top_logprobs entry that was a list ({token, logprob} objects, chat's shape) was
    an AttributeError traceback out of `oracle export`."""
    with in_thread(oracle_peer("chat_shape")) as url:
        _export(run_cli, url, tmp_path / "ref", prompts)
        export = json.loads((tmp_path / "ref" / "export.json").read_text())
    assert export["prompts"][0]["steps"][0]["top"] == {"a": -0.1, "zz": -2.5, "yy": -9999.0}


@pytest.mark.parametrize(
    "value, kind",
    [("x", "str"), (None, "NoneType")],
)
def test_an_export_with_an_alternative_that_is_no_number_is_one_line(run_cli, tmp_path, prompts, value, kind):
    """Before: a hand-edited export.json whose top held a string or null passed the schema check
    and was a TypeError traceback inside the comparison."""
    with in_thread(oracle_peer("vllm")) as url:
        _export(run_cli, url, tmp_path / "ref", prompts)
        path = tmp_path / "ref" / "export.json"
        export = json.loads(path.read_text())
        export["prompts"][0]["steps"][0]["top"]["zz"] = value
        path.write_text(json.dumps(export))
        code, _out, err = run_cli("oracle", "compare", str(tmp_path / "ref"), "--base-url", url + "/v1")
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"export.prompts[0].steps[0].top.zz: expected ['number'], got {kind}" in " ".join(err.split())


def _bundle(tmp_path: Path, request: bytes) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "request.json").write_bytes(request)
    manifest = {
        "needlescope_version": "0.1.0",
        "created": 1.0,
        "case_id": "single-L200-D0-T0",
        "expected": ["1234"],
        "failure": None,
        "base_url": None,
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


@pytest.mark.parametrize(
    "request_bytes, says",
    [
        (b"\xff\xfe{not utf-8", "is not UTF-8 text"),
        (json.dumps({"model": MODEL, "messages": ["hi", 3]}).encode(), "is not a chat-completions body"),
        (
            json.dumps({"model": None, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            "is not a chat-completions body",
        ),
    ],
    ids=["not-utf8", "messages-not-objects", "model-null"],
)
def test_a_broken_bundle_is_one_line_exit_2_never_a_target_failure(run_cli, tmp_path, request_bytes, says):
    """Before: a request.json of bytes that are not UTF-8 was a UnicodeDecodeError traceback; one
    whose messages were not objects was sent, refused by the server, and reported as 'target
    failed: none of 1 request(s) ... was answered; check --base-url' (exit 1); a null model as
    'model None not served'."""
    bundle = _bundle(tmp_path, request_bytes)
    with in_thread(bisect_peer(fail_from=10**9)) as url:
        code, _out, err = run_cli("replay", str(bundle), "--base-url", url + "/v1")
    assert code == 2, err
    assert err.startswith("error: ") and says in " ".join(err.split()) and "target failed" not in err


def bisect_peer(fail_from: int, fail_deep: bool = False):
    """A chat peer that recalls every needle, but answers HTTP 400 (no retry) to every needle chat
    of at least ``fail_from`` words (a length where every request fails) and, with ``fail_deep``,
    to every needle chat whose fact lies past the middle of the prompt."""

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self._send(200, {"count": len(render_words(body.get("messages", [])))})
                return
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            words = len(render_words(body["messages"]))
            deep = fail_deep and (needle_depth(body["messages"]) or 0) > 50
            if (body.get("max_tokens") or 0) > 1 and (words >= fail_from or deep):
                self._send(400, {"error": {"message": "request rejected", "code": "rejected"}})
                return
            message = {"role": "assistant", "content": answer(body["messages"], window=100_000)}
            usage = {"prompt_tokens": words, "completion_tokens": 1}
            self._send(
                200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}
            )

    return Handler


def test_a_bisection_does_not_conclude_from_a_length_where_every_request_failed(run_cli, tmp_path):
    """Before: every request at the longest length failed, and the bisection, reading only the
    lengths that answered, said 'recall stays at or above 0.85 at every tested length; raise the
    longest --lengths' (exit 2, as if the range were wrong); with every request failing it said
    the same of a dead target."""
    out = tmp_path / "bis"
    with in_thread(bisect_peer(fail_from=700)) as url:
        code, stdout, err = run_cli(
            "probe", "--bisect", "--base-url", url + "/v1", "--model", MODEL, "--kind", "single",
            "--lengths", "200,800", "--depths", "50", "--trials", "1", "--boundaries", "64",
            "--resolution", "64", "--out", str(out),
        )  # fmt: skip
    text = " ".join((stdout + err).split())
    assert code == 1, text  # the target failed, as at a midpoint where every request failed
    assert "recall stays at or above" not in text and not (out / "bisect.json").exists()
    assert "target failed: every request at 800 tokens failed, so no recall was measured there" in text
    assert "rerun the same command with --resume" in text


def test_the_export_line_says_how_many_alternatives_came_back_not_only_how_many_were_asked(
    run_cli, tmp_path, prompts
):
    """Before: a server that sent 3 alternatives a token (or none) was reported as exported
    'with top-20 logprobs', the number asked for."""
    with in_thread(oracle_peer("vllm")) as url:
        code, out, err = run_cli(
            "oracle",
            "export",
            "--base-url",
            url + "/v1",
            "--out",
            str(tmp_path / "ref"),
            "--prompts",
            prompts,
        )
        assert code == 0, err
        assert (
            "5 generated tokens with logprobs (top-20 asked; the server returned at most 3 alternatives a token)"
            in out
        )
        code, out, err = run_cli(
            "oracle", "export", "--base-url", url + "/v1", "--out", str(tmp_path / "top3"), "--prompts", prompts,
            "--top-logprobs", "3",
        )  # fmt: skip
    assert code == 0, err
    assert "5 generated tokens with top-3 logprobs (prompt ids from tokenize)" in out


def test_a_bisection_that_lost_requests_says_so_in_its_printed_result(run_cli, tmp_path):
    """Before: requests that failed (and stayed failed) were counted only in bisect.md; the
    terminal printed the result as if every request had been answered."""
    out = tmp_path / "bis"
    with in_thread(bisect_peer(fail_from=10**9, fail_deep=True)) as url:
        code, stdout, err = run_cli(
            "probe", "--bisect", "--base-url", url + "/v1", "--model", MODEL, "--kind", "single",
            "--lengths", "200,800", "--depths", "0,100", "--trials", "1", "--boundaries", "64",
            "--resolution", "64", "--out", str(out),
        )  # fmt: skip
    failed = json.loads((out / "bisect.json").read_text())["errors"]
    text = " ".join((stdout + err).split())
    assert code == 2 and failed == 5, text  # no bracket: recall 1/1 at every length, depth 100 failed
    assert f"; {failed} request(s) failed and are not counted as misses" in text


def _strict(path: Path) -> dict:
    """``path`` read as strict JSON: NaN and Infinity, which jq and JavaScript refuse, fail."""

    def refuse(constant: str):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_exports_and_oracle_results_are_strict_json_whatever_the_logprobs(run_cli, tmp_path, prompts):
    """Before: a server's -inf went into export.json as -Infinity, and an unbounded |Δ| or KL
    (probability 0 on one side only) into oracle.json as Infinity: files jq and browsers refuse."""
    from needlescope.report.oracle import read_oracle

    with in_thread(oracle_peer("inf")) as inf, in_thread(oracle_peer("finite")) as finite:
        _export(run_cli, inf, tmp_path / "ref", prompts)
        step = _strict(tmp_path / "ref" / "export.json")["prompts"][0]["steps"][0]
        assert step["top"]["yy"] == -9999.0  # probability 0, as vLLM writes it
        code, out, err = run_cli(
            "oracle", "compare", str(tmp_path / "ref"), "--base-url", finite + "/v1", "--out", str(tmp_path / "c")
        )  # fmt: skip
    assert code == 0, err
    summary = _strict(tmp_path / "c" / "oracle.json")["summary"]
    assert summary["max_abs_dlogprob"] == "inf" and summary["verdict"] == "same_tokens"
    assert read_oracle(tmp_path / "c" / "oracle.json")["summary"]["max_abs_dlogprob"] == float("inf")
