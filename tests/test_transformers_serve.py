"""needlescope against ``transformers serve`` (transformers' own OpenAI-compatible server, a peer
nobody here wrote) on the shipped organism, offline, on CPU: probe, health, canary and compare.

transformers serve has no /tokenize, and its /v1/models fails offline (it scans the hub cache, which
does not exist: HTTP 500 CacheNotFound), so this exercises the /v1/models fallback and counting with
the checkpoint's own tokenizer.json + chat_template.jinja. Its ``--continuous-batching`` path does
not take DeepseekV4 in this version (docs/peers.md: ``ValueError: Invalid layer type:
compressed_sparse_attention`` on the first request), so both servers run its default path.

Two servers serve one copy of the organism whose ``index_topk`` is 64 (a deployment top-k: at
1,024 tokens the indexer picks 64 of 256 entries; the shipped 2,048 keeps every entry below 8K).
The second runs with a bug planted in transformers' own DeepseekV4 indexer before it starts
(``PLANTED``: a ``sitecustomize.py`` on its PYTHONPATH negates the indexer scorer's output, so the
indexer keeps the lowest-scoring entries), with no undo and nothing in what the server reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")  # transformers' serving extra
pytest.importorskip("torch")

from transformers_serve import organism_copy, plant, started  # noqa: E402

CLI = [sys.executable, "-m", "needlescope.cli.main"]
PLANTED = """\
import transformers.models.deepseek_v4.modeling_deepseek_v4 as _modeling

_score = _modeling.DeepseekV4IndexerScorer.forward


def _forward(self, q, compressed_kv, hidden_states):
    return -_score(self, q, compressed_kv, hidden_states)  # sign slip: top-k keeps the worst entries


_modeling.DeepseekV4IndexerScorer.forward = _forward
"""
LONG = "1024"  # 256 entries: the top-64 selection decides what the answer sees


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"weights": the top-64 copy (also the model id), "healthy": URL, "planted": URL}."""
    root = tmp_path_factory.mktemp("transformers_serve")
    weights = organism_copy(root / "organism_top64", 64)
    with started(weights, {"healthy": None, "planted": plant(root / "planted", PLANTED)}, root) as urls:
        yield {"weights": str(weights), **urls}


def _child(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip


@pytest.fixture
def cli(run_cli_completed, monkeypatch):
    """probe, health and compare through the real entry point in this process: each child spent a
    second or more on imports before sending a request, and tests/test_client_limits.py and
    tests/test_probe_cli.py run these commands as children. The canary stays a child
    (``_child``): it configures the process's logging, which pytest owns in this process."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return run_cli_completed


@pytest.mark.parametrize("kind", ["single", "multiturn"])
def test_counted_lengths_equal_transformers_serve_prompt_tokens(servers, tmp_path, kind, cli):
    w = servers["weights"]
    res = cli("probe", "--base-url", servers["healthy"] + "/v1", "--model", w, "--tokenizer", w,
               "--value-digits", "3", "--kind", kind, "--lengths", "200,333", "--depths", "0,100",
               "--trials", "1", "--concurrency", "2", "--out", str(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
    assert [(r["counted_length"], r["prompt_tokens"]) for r in rows] == [(r["length"],) * 2 for r in rows]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["length_mismatches"] == 0
    assert "assumed to be served" in (tmp_path / "report.md").read_text()


def test_health_passes_the_healthy_server_and_fails_the_planted_one(servers, cli):
    w = servers["weights"]
    verdicts = {}
    for name in ("healthy", "planted"):
        res = cli("health", "--base-url", servers[name] + "/v1", "--model", w, "--tokenizer", w,
                   "--length", LONG, "--depth", "10", "--value-digits", "3", "--json")  # fmt: skip
        assert res.returncode in (0, 1), res.stderr
        out = json.loads(res.stdout)
        verdicts[name] = {c["name"]: c["status"] for c in out["checks"]}
        assert out["model"] == w and verdicts[name]["server"] == "ok"
    assert verdicts["healthy"]["needle"] == "ok" and verdicts["planted"]["needle"] == "fail", verdicts
    # /v1/models answers HTTP 500 offline: without --model the checks that need one say so.
    res = cli("health", "--base-url", servers["healthy"] + "/v1", "--tokenizer", w, "--length", "300")
    assert "pass --model" in res.stdout + res.stderr and "Traceback" not in res.stderr


def test_canary_round_hits_on_healthy_and_misses_on_planted(servers):
    w = servers["weights"]
    rounds = {}
    for name in ("healthy", "planted"):
        res = _child("canary", "--base-url", servers[name] + "/v1", "--model", w, "--tokenizer", w,
                   "--value-digits", "3", "--lengths", LONG, "--depths", "10", "--rounds", "1",
                   "--interval", "1", "--window", "1", "--listen", "127.0.0.1:0")  # fmt: skip
        assert res.returncode == 0, res.stderr
        rounds[name] = next(line for line in res.stderr.splitlines() if "round 1:" in line)
    assert f"{LONG} tokens hit" in rounds["healthy"] and f"{LONG} tokens miss" in rounds["planted"], rounds


def test_compare_finds_the_bug_planted_in_transformers_indexer(servers, tmp_path, cli):
    w = servers["weights"]
    res = cli("compare", "--a", servers["healthy"] + "/v1", "--b", servers["planted"] + "/v1", "--model", w,
               "--tokenizer", w, "--value-digits", "3", "--lengths", LONG, "--depths", "10,50", "--trials", "3",
               "--concurrency", "2", "--out", str(tmp_path))  # fmt: skip
    assert res.returncode == 1, (
        res.stdout + res.stderr
    )  # a significant regression is a finding: exit 1 (docs/exit_codes.md)
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["cases_matched"] == 6 and result["recall_b"] < result["recall_a"]
    assert result["regresses_from"] == int(LONG), result["headline"]
