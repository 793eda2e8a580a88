"""The logprob oracle against real servers on loopback: the organism at its reference, with the
prefix cache, and with a planted indexer fault; the scripted server (another tokenizer, no
completions); a server that answers completions without logprobs."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import openai
import pytest

from needlescope.cli.main import main
from needlescope.report.oracle import write_export, write_oracle
from needlescope.run.oracle import OracleConfig, compare, export, load_prompt_set
from needlescope.serve.launch import ServerProcess
from needlescope.testing.servers import in_thread, scripted

FAULT = ["--patch", "fault:indexer_page_table", "--index-topk", "16"]


@contextmanager
def _stdlib_server(answer):
    """A loopback HTTP server whose POSTs ``answer(path, body) -> (status, json)`` handles; yields its /v1 URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            status, body = answer(self.path, json.loads(self.rfile.read(int(self.headers["content-length"]))))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with in_thread(Handler) as root:
        yield root + "/v1"


@pytest.fixture(scope="module")
def servers(organism_server):
    """The plain organism (shared with the other files serving it), one with a prefix cache (this
    file's own: its tests count cached tokens) and the planted fault."""
    procs = {
        "cached": ServerProcess(["--model", "organism", "--port", "0", "--prefix-cache-mib", "16"]),
        "fault": ServerProcess(["--model", "organism", "--port", "0", *FAULT]),
    }
    try:
        with ThreadPoolExecutor(3) as pool:
            ref = pool.submit(organism_server)
            list(pool.map(lambda p: p.start(), procs.values()))
            urls = {"ref": ref.result(), **{k: p.url for k, p in procs.items()}}
        yield urls
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A short prompt and a 256-token needle prompt from the shipped set (which needs minutes)."""
    shipped = load_prompt_set()
    keep = [p for p in shipped.prompts if p["id"] in ("arith-add", "needle-single-256-d50")]
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps({"name": "test", "prompts": keep}))
    return str(path)


@pytest.fixture(scope="module")
def ref_dir(servers, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    write_export(export(OracleConfig(servers["ref"], prompts=prompts)), out)
    return out


@pytest.fixture(scope="module")
def other_tokenizer():
    """The scripted server: whitespace-word token ids, /tokenize, and no /v1/completions."""
    with scripted(model="organism") as srv:
        yield srv.url + "/v1"


@pytest.fixture
def cli(capsys, monkeypatch):
    """``needlescope ARGS`` through the real entry point, in this process (a fresh interpreter
    would import torch for the CLI's other commands): (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["needlescope", *args])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_the_organism_compared_with_itself_is_identical(servers, ref_dir):
    result, _ = compare(ref_dir, OracleConfig(servers["ref"]))
    s = result["summary"]
    assert (s["verdict"], s["prompt_ids_equal"], s["identical"], s["diverged"]) == ("identical", 2, 2, 0)
    assert s["max_abs_dlogprob"] == 0.0 and s["top1_agreement"] == 1.0 and s["topk_overlap"] == 1.0
    assert s["positions_compared"] > 2


def test_prefix_cache_answers_equal_a_single_prefill_and_report_cached_tokens(servers, ref_dir):
    cold, _ = compare(ref_dir, OracleConfig(servers["cached"]))
    warm, _ = compare(ref_dir, OracleConfig(servers["cached"]))  # every prompt now continues a kept prefix
    for r in (cold, warm):
        assert r["summary"]["diverged"] == 0 and r["summary"]["flips_at_low_margin"] == 0
        assert r["summary"]["max_abs_dlogprob"] < 1e-3
    client = openai.OpenAI(base_url=servers["cached"] + "/v1", api_key="none")
    needle = next(p["prompt"] for p in load_prompt_set().prompts if p["id"] == "needle-single-256-d50")
    again = client.completions.create(model="organism", prompt=needle, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens == 256 and again.usage.prompt_tokens_details.cached_tokens == 128
    plain = openai.OpenAI(base_url=servers["ref"] + "/v1", api_key="none")
    first = plain.completions.create(model="organism", prompt=needle, max_tokens=4, temperature=0)
    assert (
        first.choices[0].text == again.choices[0].text
        and first.usage.prompt_tokens_details.cached_tokens == 0
    )


def test_a_planted_indexer_fault_is_found_and_the_cli_exits_1(servers, ref_dir, tmp_path, cli):
    code, out, err = cli(
        "oracle", "compare", str(ref_dir), "--base-url", servers["fault"], "--out", str(tmp_path)
    )
    assert code == 1, err
    assert "Verdict: **divergent**" in out
    result = json.loads((tmp_path / "oracle.json").read_text())
    rows = {p["id"]: p for p in result["prompts"]}
    assert result["summary"]["verdict"] == "divergent"
    assert rows["arith-add"]["verdict"] == "identical"  # shorter than one window: no entry to select
    needle = rows["needle-single-256-d50"]
    assert needle["first_divergence"] is not None and needle["verdict"] == "diverged"
    assert "Verdict: **divergent**" in (tmp_path / "oracle.md").read_text()


def test_a_server_with_another_tokenizer_is_refused_at_the_first_prompt(
    ref_dir, tmp_path, cli, other_tokenizer
):
    code, _, err = cli(
        "oracle", "compare", str(ref_dir), "--base-url", other_tokenizer, "--out", str(tmp_path)
    )
    assert code == 2
    assert "tokenizes differently from the reference" in err and "'arith-add'" in err
    assert not (tmp_path / "oracle.json").exists()


def test_a_server_without_completions_or_logprobs_is_bad_input(prompts, tmp_path, cli, other_tokenizer):
    code, _, err = cli(
        "oracle", "export", "--base-url", other_tokenizer, "--out", str(tmp_path), "--prompts", prompts
    )
    assert code == 2 and "has no /v1/completions (HTTP 404)" in err, err

    def no_logprobs(path: str, body: dict) -> tuple[int, dict]:
        if path == "/tokenize":
            return 200, {"tokens": [1, 2, 3], "count": 3}
        return 200, {"choices": [{"text": " 42", "finish_reason": "length", "logprobs": None}]}

    with _stdlib_server(no_logprobs) as url:
        code, _, err = cli(
            "oracle",
            "export",
            "--base-url",
            url,
            "--model",
            "m",
            "--out",
            str(tmp_path),
            "--prompts",
            prompts,
        )
    assert code == 2 and "without logprobs" in err, err
    assert "Traceback" not in err and not (tmp_path / "export.json").exists()


def test_compare_puts_the_oracle_verdict_beside_recall(servers, ref_dir, tmp_path, cli, other_tokenizer):
    result, _ = compare(ref_dir, OracleConfig(servers["fault"]))
    oracle_dir = tmp_path / "oracle"
    write_oracle(result, oracle_dir)
    out = tmp_path / "ab"
    code, stdout, err = cli(
        "compare",
        "--a",
        other_tokenizer,
        "--b",
        other_tokenizer,
        "--model",
        "organism",
        "--lengths",
        "200",
        "--depths",
        "50",
        "--trials",
        "2",
        "--out",
        str(out),
        "--oracle",
        str(oracle_dir / "oracle.json"),
    )
    assert code == 0, err
    report = (out / "report.md").read_text()
    assert report.index("**Verdict:**") < report.index("## Logprob oracle")
    assert "Verdict: **divergent**" in report and "logprob oracle: divergent" in stdout
    code, _, err = cli(
        "compare",
        "--a",
        other_tokenizer,
        "--b",
        other_tokenizer,
        "--model",
        "organism",
        "--out",
        str(tmp_path / "x"),
        "--oracle",
        str(tmp_path / "missing.json"),
    )
    assert code == 2 and "is not a readable oracle.json" in err


def test_without_tokenize_the_echoed_prompt_tokens_stand_in_for_ids(prompts, tmp_path):
    """A server with no /tokenize: the export records prompt_ids_source 'echo' and compares token texts."""

    def echo_server(path: str, body: dict) -> tuple[int, dict]:
        if path != "/v1/completions":
            return 404, {"error": {"message": "no route"}}
        words = body["prompt"].split()
        gen = ["a", "b"][: body["max_tokens"]]
        toks = (words if body["echo"] else []) + gen
        lps = ([None] + [-1.0] * (len(words) - 1) if body["echo"] else []) + [-0.1] * len(gen)
        tops = [None if lp is None else {t: lp, "zz": lp - 2} for t, lp in zip(toks, lps, strict=True)]
        lp = {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops}
        usage = {"prompt_tokens": len(words), "completion_tokens": len(gen)}
        return 200, {
            "choices": [{"text": " ".join(gen), "finish_reason": "length", "logprobs": lp}],
            "usage": usage,
        }

    with _stdlib_server(echo_server) as url:
        body = export(OracleConfig(url, model="m", prompts=prompts))
        write_export(body, tmp_path)
        result, _ = compare(tmp_path, OracleConfig(url, model="m"))
    assert body["prompt_ids_source"] == "echo"
    first = body["prompts"][0]
    assert first["prompt_ids"] is None and first["prompt_tokens"] == first["prompt"].split()
    assert result["summary"]["verdict"] == "identical" and result["summary"]["prompt_ids_equal"] == 2
