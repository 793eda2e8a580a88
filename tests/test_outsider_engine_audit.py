"""Outsider regressions of ``needlescope engine-state`` and ``needlescope audit``.

engine-state runs against a peer that answers like an OpenAI-compatible server with a quirk
(a real HTTP server on 127.0.0.1, stdlib, in a thread; its answers follow the scripted server's
rules, so every needle is recalled unless the quirk says otherwise): a warm send that always
fails, a token sent with ``"logprob": null``, replicas of which only some return logprobs, a
Ctrl-C while the concurrent arm is in flight. audit runs the real CLI on the shipped organism
and on copies of it with a planted defect.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from needlescope.testing.scripted_server import answer, render_words
from needlescope.testing.servers import JsonHandler, in_thread

MODEL = "peer"
GRID = ["--lengths", "200", "--depths", "0,100", "--trials", "1"]


def peer(mode: str = "", *, on_chat=None):
    """A handler class for ``in_thread``; ``mode`` picks the quirk of its chat answers:

    ``warm_fails``: the second send of a prompt it has seen answers HTTP 500 (a prefix-cache
    path that crashes); ``null_logprob``: every token comes with ``"logprob": null``;
    ``logprobs_on_odd``: only odd-numbered chats carry logprobs (a router over two replicas, one
    started without them); ``round_robin``: even-numbered chats go to a replica without a prefix
    cache that answers every needle wrong. ``on_chat(n)`` is called as chat ``n`` (1, 2, ...)
    arrives."""
    lock = threading.Lock()
    seen: dict[tuple, int] = {}
    count = [0]

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif self.path == "/get_server_info":
                self._send(200, {"context_length": 4096, "trained_value_digits": 4})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/tokenize":
                self._send(200, {"count": len(render_words(body.get("messages", [])))})
            elif self.path == "/v1/chat/completions":
                self._chat(body)
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def _chat(self, body: dict) -> None:
            words = tuple(render_words(body["messages"]))
            with lock:
                count[0] += 1
                n, before = count[0], seen.get(words, 0)
                seen[words] = before + 1
            if on_chat is not None:
                on_chat(n)
            if mode == "warm_fails" and before == 1:
                self._send(500, {"error": {"message": "prefix cache path crashed"}})
                return
            text = answer(body["messages"], window=100_000)
            other_replica = mode == "round_robin" and n % 2 == 0
            if other_replica:
                text, before = "0" * len(text), 0  # its own (empty) cache, and a wrong answer
            lp = None if mode == "null_logprob" else -0.01
            steps = [
                {
                    "token": t,
                    "logprob": lp,
                    "top_logprobs": [{"token": t, "logprob": lp}, {"token": "x", "logprob": -5.0}],
                }
                for t in text
            ]
            choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
            if not (mode == "logprobs_on_odd" and n % 2 == 0):
                choice["logprobs"] = {"content": steps}
            usage = {"prompt_tokens": len(words), "completion_tokens": len(text), "total_tokens": len(words)}
            usage["prompt_tokens_details"] = {"cached_tokens": len(words) - 1 if before else 0}
            self._send(
                200,
                {
                    "id": f"c{n}",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [choice],
                    "usage": usage,
                },
            )

    return Handler, count


@pytest.fixture
def engine_state(run_cli, tmp_path):
    """``engine_state(handler, *flags)`` -> (code, stdout, stderr, engine_state.json or None)."""

    def run(handler, *flags: str):
        out = tmp_path / "es"
        with in_thread(handler) as url:
            code, stdout, stderr = run_cli(
                "engine-state", "--base-url", url, "--model", MODEL, "--out", str(out), *flags
            )
        js = out / "engine_state.json"
        strict = {"parse_constant": _refuse}  # NaN or Infinity: not JSON
        return code, stdout, stderr, json.loads(js.read_text(), **strict) if js.exists() else None

    return run


def _refuse(token: str):
    raise AssertionError(f"the file holds {token}, which is not JSON")


def test_a_factor_whose_every_pair_failed_reports_no_recall_rather_than_zero(engine_state):
    """Every warm send fails: no pair is scored, so there is no recall on either side; it once
    read `recall A 0.00, recall B 0.00, Δ +0.00, McNemar p 1` in the table and the JSON."""
    handler, _ = peer("warm_fails")
    code, out, err, body = engine_state(handler, "--factors", "cache", *GRID)
    assert code == 1 and "no scored pair in: cache" in err
    effect = body["factors"]["cache"]["effect"]
    assert (effect["pairs"], effect["errors"]) == (0, 2)
    assert [effect[k] for k in ("recall_a", "recall_b", "recall_delta", "mcnemar_p")] == [None] * 4
    assert "| cache | cold vs warm | 0 | - | - | - | - |" in out
    cold, warm = body["factors"]["cache"]["rows"]
    assert all(r["correct"] is True for r in cold) and all(r["correct"] is None for r in warm)


def test_a_token_without_its_logprob_gives_no_margin_and_strict_json(engine_state):
    """``"logprob": null`` on every token (read as NaN): the margin is unknown (null), never NaN
    in engine_state.json (which jq refuses) or `nan` in the table."""
    handler, _ = peer("null_logprob")
    code, out, err, body = engine_state(handler, "--factors", "cache", *GRID)
    assert code == 0, err
    cache = body["factors"]["cache"]
    assert cache["effect"]["pairs"] == 2 and cache["effect"]["recall_a"] == 1.0
    assert all(r["margin"] is None for rows in cache["rows"] for r in rows)
    assert cache["effect"]["margin"]["n"] == 0 and "nan" not in out


def test_replicas_differing_only_in_logprobs_are_not_answer_differences(engine_state):
    """A router over two replicas, one without logprobs: the same answer "1234" arrives as tokens
    ["1", "2", "3", "4"] from one and as the text from the other. It was counted as an answer
    that differs at token 0 in every pair and a determinism rate of 0.00."""
    handler, _ = peer("logprobs_on_odd")
    code, out, err, body = engine_state(handler, "--factors", "cache,repeat", "--repeats", "2", *GRID)
    assert code == 0, err
    cache, repeat = body["factors"]["cache"], body["factors"]["repeat"]
    cold, warm = cache["rows"]
    assert all(c["text"] == w["text"] and c["tokens"] != w["tokens"] for c, w in zip(cold, warm, strict=True))
    assert cache["effect"]["answers_differ"] == 0 and cache["effect"]["first_differing_tokens"] == []
    assert repeat["effect"]["answers_differ"] == 0 and repeat["effect"]["determinism_rate"] == 1.0
    assert "1.00 of cases answered token for token the same every time." in out


def test_ctrl_c_in_the_concurrent_arm_sends_nothing_more(engine_state):
    """Ctrl-C while the c2 arm has 2 sends in flight and 6 queued: it exits 130 once the ones in
    flight are done. It used to send all 6 queued ones first (unrecorded: lost work, and minutes
    on a slow server)."""
    cases = 8
    interrupt_at = 2 * cases + 2  # warm-up and c1 done, the c2 arm's first two in flight

    def on_chat(n: int) -> None:
        if n == interrupt_at:
            # a real SIGINT, as a terminal's Ctrl-C sends: _thread.interrupt_main() only sets a flag the
            # main thread reads at its next bytecode, which a loaded box delayed past the run's end (exit 0)
            os.kill(os.getpid(), signal.SIGINT)
        if n > 2 * cases:
            threading.Event().wait(0.3)  # the c2 sends are slow, so the rest are still queued

    handler, count = peer(on_chat=on_chat)
    grid = ["--lengths", "200,300", "--depths", "0,33,66,100", "--trials", "1"]
    # A run started in the background (`make test &`, CI scripts) inherits SIGINT ignored, so the
    # signal below would be dropped: Python's own Ctrl-C handler for this test, as a terminal has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err, body = engine_state(handler, "--factors", "concurrency", "--concurrency", "2", *grid)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and body is None, err
    assert "interrupted: " in err and "sends saved; rerun the same command with --resume" in err
    # At most one more send per worker, taken up as its send in flight finished before the stop.
    assert count[0] - interrupt_at <= 2, count[0]


@pytest.fixture(scope="module")
def organism_copies(tmp_path_factory):
    """Copies of the shipped organism: ``short`` says its context is 300 tokens (config.json
    only), ``nan`` has NaN in layer 1's router weights (a corrupted checkpoint that loads)."""
    torch = pytest.importorskip("torch")
    import shutil

    from safetensors.torch import load_file, save_file

    from needlescope.dsa.checkpoint import shipped_dir

    root = tmp_path_factory.mktemp("organisms")
    short, nan = (shutil.copytree(shipped_dir(), root / name) for name in ("short", "nan"))
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 300}))
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.1.ffn.gate.weight"] = torch.full_like(
        weights["model.layers.1.ffn.gate.weight"], torch.nan
    )
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    return {"short": short, "nan": nan}


def _one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_audit_refuses_a_length_beyond_the_context_before_loading(run_cli, organism_copies, tmp_path):
    """``--length 100000`` on the organism built the prompt and ran it: killed for memory (137).
    Shown on a copy that says its context is 300 tokens, where 400 ran and exited 0."""
    out = tmp_path / "audit.json"
    code, stdout, err = run_cli(
        "audit", "--model", str(organism_copies["short"]), "--length", "400", "--checks", "routed_scale",
        "--out", str(out),
    )  # fmt: skip
    line = _one_error_line(code, err)
    assert "--length 400" in line and "context is 300 tokens" in line and "up to 300" in line
    assert stdout == "" and not out.exists()


def test_audit_refuses_checks_that_name_no_check(run_cli):
    """``--checks ,`` printed an empty table and exited 0: an audit that checked nothing, read
    as clean."""
    line = _one_error_line(*run_cli("audit", "--checks", ",")[::2])
    assert "names no check" in line and "hc_mix_bf16" in line


def test_audit_top_k_checks_refuse_a_prompt_too_short_to_select(run_cli):
    """At 256 tokens the last query row sees 256 / 4 = 64 entries, so the default candidate's
    top-64 selects all of them in every row: the overlap was 1.000 over no row compared, "not
    flagged", fp8 keys "keep 1.000 of the fp32 top-64"."""
    line = _one_error_line(*run_cli("audit", "--length", "256", "--checks", "index_keys_fp8")[::2])
    assert "index_keys_fp8" in line and "sees 64" in line and "at least 260" in line


def test_audit_of_a_checkpoint_that_makes_nan_is_flagged_in_strict_json(run_cli, organism_copies, tmp_path):
    """NaN router weights: every metric that is NaN flags its check and the reason names it; the
    routed scale is not "as configured"; audit.json holds "nan" strings, not NaN (not JSON)."""
    out = tmp_path / "audit.json"
    code, _, err = run_cli(
        "audit", "--model", str(organism_copies["nan"]), "--length", "64",
        "--checks", "routed_scale,hc_mix_bf16", "--out", str(out),
    )  # fmt: skip
    assert code == 1 and "flagged: routed_scale, hc_mix_bf16" in err, err  # a finding: exit 1
    results = {r["check"]: r for r in json.loads(out.read_text(), parse_constant=_refuse)}
    scale = results["routed_scale"]
    assert scale["flagged"] and "as configured" not in scale["why"], scale["why"]
    assert "not finite: effective routed scale" in scale["why"]
    hc = results["hc_mix_bf16"]
    assert hc["flagged"] and "not finite: " in hc["why"] and "compounded mean KL" in hc["why"]
    assert "nan" in [m["value"] for m in hc["metrics"]]


def test_a_warm_send_served_without_the_cold_prefix_is_said_to_compare_two_cold_sends(engine_state):
    """A router alternating over two replicas: every cold send lands on one, every warm send on
    the other (no cache, wrong answers). The cache factor's recall 1.00 vs 0.00 is then a replica
    difference; the table's mean cached tokens 0 / 0 was the only hint. Now a line says that
    every pair's warm send reused nothing more than its cold one."""
    handler, _ = peer("round_robin")
    code, out, err, body = engine_state(handler, "--factors", "cache", *GRID)
    assert code == 0, err
    cache = body["factors"]["cache"]
    assert (cache["effect"]["recall_a"], cache["effect"]["recall_b"]) == (1.0, 0.0)
    assert cache["warm_not_reused"] == 2
    assert "Cache: in 2 of 2 pair(s) the warm send reused no more of the prompt than its cold one" in out
