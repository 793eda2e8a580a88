"""Paired A/B on the shipped organism at two settings, through the real CLI and two real servers."""

from __future__ import annotations

import json

DEPLOYMENT = ["--patch", "fault:indexer_page_table", "--index-k", "fp8_e4m3", "--index-topk", "64"]


def test_compare_finds_the_page_table_fault_on_the_organism(tmp_path, organism_server, run_cli_completed):
    # The real entry point in this process (a child spent seconds importing torch first); the
    # two servers are children, shared with the other files serving the same flags.
    ref, dep = organism_server(), organism_server(*DEPLOYMENT)
    res = run_cli_completed(
        "compare", "--a", ref, "--b", dep, "--model", "organism", "--kind", "multiturn",
        "--lengths", "1024", "--depths", "0,25,50,75,100", "--trials", "2", "--value-digits", "3",
        "--concurrency", "4", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 1, res.stderr  # B regresses: a finding (docs/exit_codes.md)
    compare = json.loads((tmp_path / "compare.json").read_text())
    (bucket,) = compare["buckets"]
    assert bucket["n"] == 10 and bucket["recall_a"] >= 0.9 and bucket["recall_b"] <= 0.3
    assert compare["regresses_from"] == 1024 and bucket["p_holm"] < 0.05
    assert "B regresses from 1024 tokens" in res.stdout
