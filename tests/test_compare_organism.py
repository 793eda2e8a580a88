"""Paired A/B on the shipped organism at two settings, through the real CLI and two real servers."""

from __future__ import annotations

import json
import subprocess
import sys

from needlescope.serve.launch import ServerProcess

DEPLOYMENT = ["--patch", "fault:indexer_page_table", "--index-k", "fp8_e4m3", "--index-topk", "64"]


def test_compare_finds_the_page_table_fault_on_the_organism(tmp_path):
    with (
        ServerProcess(["--model", "organism", "--port", "0"]) as ref,
        ServerProcess(["--model", "organism", "--port", "0", *DEPLOYMENT]) as dep,
    ):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "needlescope.cli.main",
                "compare",
                "--a",
                ref.url,
                "--b",
                dep.url,
                "--model",
                "organism",
                "--kind",
                "multiturn",
                "--lengths",
                "1024",
                "--depths",
                "0,25,50,75,100",
                "--trials",
                "2",
                "--value-digits",
                "3",
                "--concurrency",
                "4",
                "--out",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert res.returncode == 0, res.stderr
    compare = json.loads((tmp_path / "compare.json").read_text())
    (bucket,) = compare["buckets"]
    assert bucket["n"] == 10 and bucket["recall_a"] >= 0.9 and bucket["recall_b"] <= 0.3
    assert compare["regresses_from"] == 1024 and bucket["p_holm"] < 0.05
    assert "B regresses from 1024 tokens" in res.stdout
