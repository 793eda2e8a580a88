"""Black-box patterns named by the probe's headline, each against a scripted server planted with it.

Planted (``needlescope.testing.scripted_server``): a stale response cache reused across requests
(``--fault stale``), a serving layer that drops the middle of long prompts (``--truncate-middle``)
and a server wrong only for needles at 40-60% depth (``--fault-depth 40:60``); the control is the
plain recall window (a real length cliff), which must keep its length headline and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from needlescope.report.probe import validate_summary

DEPTHS = "0,25,50,75,100"


@pytest.fixture
def probe(run_cli_completed):
    """``needlescope probe`` of the scripted model through the real entry point, in this process:
    (validated summary, stdout)."""

    def run(out: Path, url: str, lengths: str, depths: str, trials: int, *extra: str) -> tuple[dict, str]:
        res = run_cli_completed("probe", "--base-url", url, "--model", "scripted", "--out", str(out), "--kind", "single",
                                "--lengths", lengths, "--depths", depths, "--trials", str(trials), *extra)  # fmt: skip
        assert res.returncode == 0, res.stderr
        summary = json.loads((out / "summary.json").read_text())
        validate_summary(summary)
        return summary, res.stdout

    return run


def rows(out: Path) -> dict[str, dict]:
    return {r["case_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def test_answers_from_another_request_are_named_with_their_source(scripted_server, tmp_path, probe):
    # A stale cache slot: prompts of 250+ tokens get the previous chat's answer. In prefix-cache order
    # (group by group) each group's first case gets the group before's value: a "length cliff".
    url = scripted_server(fault="stale", fault_from=250)
    summary, stdout = probe(tmp_path, url, "200,300,400", "0,50,100", 4, "--concurrency", "1")
    f = summary["failures"]
    assert f["misses"] == 8 and f["counts"]["cross_case"] == 8, f["counts"]
    x = f["cross_case"]
    assert x["significant"] and x["same_connection"] == 8 and x["p_value"] < 1e-20
    head = summary["headline"][0]
    assert head.startswith("answers from other requests: possible cache or state reuse"), summary["headline"]
    assert "answers from other requests: possible cache or state reuse" in stdout
    by_id = rows(tmp_path)
    for r in (r for r in by_id.values() if r.get("failure")):
        fail = r["failure"]
        source = by_id[fail["detail"]["source_case"]]
        # The wrong answer is the source case's expected value, and the source went just before it.
        assert fail["category"] == "cross_case" and fail["value"] in source["expected"]
        assert fail["value"] not in r["expected"] and source["expected"] != r["expected"]
        assert 0 < fail["detail"]["sent_before_s"] < 30 and fail["detail"]["same_connection"] is True
        assert source["finished_at"] <= r["finished_at"]
    report = (tmp_path / "report.md").read_text()
    assert "## Headline" in report and "source_case=" in report


def test_a_dropped_middle_is_lost_in_the_middle_not_just_a_cliff(scripted_server, tmp_path, probe):
    # Prompts over 600 words keep their first and last 300: at 800 tokens depth 50 is gone, at 1600
    # every middle depth; the ends always stay.
    url = scripted_server(truncate_middle=600)
    summary, stdout = probe(tmp_path, url, "400,800,1600", DEPTHS, 3)
    prof = summary["depth_profile"]
    hole = prof["middle_hole"]
    assert (hole["middle_correct"], hole["middle_n"], hole["end_correct"], hole["end_n"]) == (15, 27, 18, 18)
    assert hole["found"] and hole["p_value"] < 0.01 and prof["pattern"] == "lost_in_the_middle"
    assert summary["headline"][0].startswith("lost in the middle: pooled recall 0.56 at the middle depths")
    assert not any("not on length" in h for h in summary["headline"])  # longer prompts lose more
    assert [d["recall"] for d in prof["depths"]] == [1.0, 2 / 3, 1 / 3, 2 / 3, 1.0]
    assert "lost in the middle" in stdout
    assert "| 50% | 0.333 |" in (tmp_path / "report.md").read_text()


def test_a_depth_band_says_depth_not_length_instead_of_no_effective_length(scripted_server, tmp_path, probe):
    url = scripted_server(fault="refusal", fault_depth="40:60")
    summary, stdout = probe(tmp_path, url, "300,600,1200", DEPTHS, 3)
    assert summary["effective_length"] is None  # pooled recall 0.8 at every length, below 0.85
    prof = summary["depth_profile"]
    assert prof["pattern"] == "depth_not_length"
    assert [t["group"] for t in prof["depth_tests"] if t["worse"]] == [50.0]
    assert not any(t["worse"] for t in prof["length_tests"])
    line = next(h for h in summary["headline"] if h.startswith("failures depend on depth, not on length"))
    assert "0.00 at depth 50%" in line
    assert not any(h.startswith("effective length") for h in summary["headline"])
    assert "failures depend on depth, not on length" in stdout and "effective length: none" not in stdout


def test_a_plain_recall_window_keeps_its_length_headline(scripted_server, tmp_path, probe):
    # Control: a real length cliff (only the last 500 words are seen) names no depth or cross-case pattern.
    url = scripted_server(window=500)
    summary, _ = probe(tmp_path, url, "200,400,800,1600", "0,50,100", 3)
    assert summary["depth_profile"]["pattern"] is None
    assert not summary["depth_profile"]["middle_hole"]["found"]
    assert (
        summary["failures"]["counts"]["cross_case"] == 0
        and not summary["failures"]["cross_case"]["significant"]
    )
    assert summary["headline"] == [
        "effective length: 400 tokens (pooled recall >= 0.85 at it and every shorter length)",
        f"cliff: 400 -> 800 tokens, pooled recall drops by {summary['cliff']['drop']:.2f}",
    ]
