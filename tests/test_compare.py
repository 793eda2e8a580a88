"""Paired A/B against real scripted loopback servers: planted regression, null rate, refusals."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from needlescope.analysis.paired import Pair, compare_pairs
from needlescope.cases import CaseSpec, build_cases, score_answer
from needlescope.report.compare import validate_compare
from needlescope.run import ResultStore, run_cases
from needlescope.targets import ChatTarget, ServerTokenCounter


@pytest.fixture
def cli(run_cli_completed):
    """The real command through its entry point, in this process."""
    return run_cli_completed


def test_compare_detects_a_planted_regression(scripted_server, tmp_path, cli):
    a = scripted_server()
    b = scripted_server(fault="near_miss", fault_from=400)
    grid = ["--lengths", "200,400,600", "--depths", "0,50,100", "--trials", "3"]
    res = cli("compare", "--a", a, "--b", b, "--model", "scripted", "--out", str(tmp_path), *grid)
    assert res.returncode == 1, res.stderr  # a regression is a finding (docs/exit_codes.md)
    compare = json.loads((tmp_path / "compare.json").read_text())
    validate_compare(compare)
    assert compare["cases_matched"] == 27
    assert compare["regresses_from"] == 400
    assert [bk["recall_b"] for bk in compare["buckets"]] == [1.0, 0.0, 0.0]
    assert compare["buckets"][0]["p_holm"] == 1.0 and compare["buckets"][1]["p_holm"] < 0.05
    assert "B regresses from 400 tokens (p=" in res.stdout
    # B was sent A's prompts byte for byte.
    a_cases = [json.loads(x) for x in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] == r["length"] for r in a_cases)
    for name in ("report.md", "delta_heatmap.png", "pairs.jsonl"):
        assert (tmp_path / name).stat().st_size > 0
    # The same verdict from the two finished runs.
    again = cli(
        "compare",
        "--a-run",
        str(tmp_path / "a"),
        "--b-run",
        str(tmp_path / "b"),
        "--out",
        str(tmp_path / "re"),
    )
    assert again.returncode == 1, again.stderr
    assert json.loads((tmp_path / "re" / "compare.json").read_text()) == compare


def _binom_upper(n: int, p: float, tail: float) -> int:
    """Smallest c with P(Binomial(n, p) > c) < tail."""
    cum = 0.0
    for c in range(n + 1):
        cum += math.comb(n, c) * p**c * (1 - p) ** (n - c)
        if 1 - cum < tail:
            return c
    return n


def test_identical_noisy_servers_false_positive_rate_within_nominal(scripted_server, tmp_path):
    # Two servers of one model that each miss 30% of cases at random (independent seeds): the null
    # is true, discordant pairs are common, and any significant bucket is a false positive. One
    # case set, re-sent to both servers per repetition (each a fresh draw of the servers' noise),
    # through the real client, SQLite store and the same statistics compare uses.
    a = scripted_server(fault="unrelated", fault_rate=0.3, fault_seed=1)
    b = scripted_server(fault="unrelated", fault_rate=0.3, fault_seed=2)
    spec = CaseSpec(kind="single", lengths=(100, 200), depths=(0, 100), trials=5, seed=0, value_digits=3)
    cases = [c.to_dict() for c in build_cases(spec, ServerTokenCounter(a, "scripted"))]
    reps, positives, discordant = 30, 0, 0

    async def side(url: str, store: ResultStore) -> None:
        async with ChatTarget(url, "scripted", retries=0) as target:
            await run_cases(
                cases, target, store, concurrency=8, max_tokens=8, extra_body=None, score=score_answer
            )

    for rep in range(reps):
        stores = [ResultStore(tmp_path / f"{rep}{s}.sqlite") for s in "ab"]
        for url, store in zip((a, b), stores):
            asyncio.run(side(url, store))
        res_a, res_b = ({r["case_id"]: r for r in st.results()} for st in stores)
        pairs = [
            Pair(
                c["case_id"],
                c["length"],
                c["depth"],
                bool(res_a[c["case_id"]]["correct"]),
                bool(res_b[c["case_id"]]["correct"]),
            )
            for c in cases
        ]
        result = compare_pairs(pairs, n_boot=200)
        positives += any(bk["p_holm"] < 0.05 for bk in result["buckets"])
        discordant += sum(p.a != p.b for p in pairs)
    # The noise is real (so the test could fail), and the rate stays within the 5% level.
    assert discordant > reps * len(cases) * 0.25
    assert positives <= _binom_upper(reps, 0.05, 0.01), positives


def test_compare_refuses_runs_with_different_case_sets(scripted_server, tmp_path, cli):
    url = scripted_server()
    grid = ["--lengths", "200", "--depths", "0,100", "--trials", "1"]
    for name, seed in (("x", "0"), ("y", "1")):
        res = cli(
            "probe",
            "--base-url",
            url,
            "--model",
            "scripted",
            "--out",
            str(tmp_path / name),
            *grid,
            "--seed",
            seed,
        )
        assert res.returncode == 0, res.stderr
    res = cli(
        "compare",
        "--a-run",
        str(tmp_path / "x"),
        "--b-run",
        str(tmp_path / "y"),
        "--out",
        str(tmp_path / "c"),
    )
    assert res.returncode == 2
    assert "do not share a case set: case single-L200-D0-T0 differs" in res.stderr
    assert "Traceback" not in res.stderr
    bad = cli(
        "compare",
        "--a-run",
        str(tmp_path / "x"),
        "--b-run",
        str(tmp_path / "nope"),
        "--out",
        str(tmp_path / "d"),
    )
    assert bad.returncode == 2 and "is not a folder" in bad.stderr
    both = cli("compare", "--a", url, "--a-run", str(tmp_path / "x"), "--out", str(tmp_path / "e"))
    assert both.returncode == 2 and "either --a URL --b URL" in both.stderr
