"""Issue 38, items 2, 16, R13, R15: compare's headline carries both recalls and says when the
pairs were too few to test (with the trials that would test it); failed requests are counted and
exit 1 (all failed too, the target-failure code, not bad usage); a dead B names --b; and
compare never writes into a probe run's folder."""

from __future__ import annotations

import json
import subprocess

import pytest

GRID = ["--kind", "single", "--lengths", "200,400", "--depths", "0,50,100"]


@pytest.fixture
def cli(run_cli_completed, monkeypatch):
    """The real command through its entry point, in this process, on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    return run_cli_completed


@pytest.fixture
def compare(cli):
    def run(a: str, b: str, out, *extra: str) -> subprocess.CompletedProcess:
        return cli("compare", "--a", a, "--b", b, "--model", "scripted", "--out", str(out), *GRID, *extra)

    return run


def test_too_few_pairs_shows_both_recalls_and_the_trials_that_would_test_it(
    scripted_server, tmp_path, compare
):
    a = scripted_server(window=100_000)
    b = scripted_server(window=100_000, fault="near_miss", fault_from=300)
    res = compare(a, b, tmp_path / "one", "--trials", "1")
    assert res.returncode == 0, res.stderr
    body = json.loads((tmp_path / "one" / "compare.json").read_text())
    headline = next(line for line in res.stdout.splitlines() if line.startswith("B "))
    assert headline.startswith("B 0.50 vs A 1.00 on 6 pairs: too few to test a 100-point difference at 400")
    assert "no detectable difference" not in headline
    assert "the run being resumed" not in res.stdout  # item 18: a fresh compare resumes nothing
    assert body["headline"] == headline and body["recall_a"] == 1.0 and body["recall_b"] == 0.5
    assert f"**Verdict:** {headline}" in (tmp_path / "one" / "report.md").read_text()
    trials = headline.rsplit("--trials ", 1)[1]
    # The suggestion is computed, and it is enough: at those trials the drop is significant.
    again = compare(a, b, tmp_path / "more", "--trials", trials)
    assert again.returncode == 1, again.stderr  # now significant: a finding
    assert "B regresses from 400 tokens" in again.stdout
    assert "B 0.50 vs A 1.00 on" in again.stdout


def test_failed_requests_are_counted_and_exit_1_never_no_difference(scripted_server, tmp_path, compare):
    a = scripted_server(window=100_000)
    b = scripted_server(window=100_000, die_after=4)  # two preflight chats, then 2 answers, then gone
    res = compare(a, b, tmp_path / "ab", "--trials", "1", "--retry-budget", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert (tmp_path / "ab" / "compare.json").exists(), res.stdout + "\n---\n" + res.stderr
    body = json.loads((tmp_path / "ab" / "compare.json").read_text())
    failed = body["errors"]["b"]["failed"]
    assert failed >= 4 and body["errors"]["cases"] == 6 and body["errors"]["a"]["failed"] == 0
    assert f"B: {failed} of 6 requests failed (transport {failed})" in res.stderr
    assert "no detectable difference" not in res.stdout
    assert f"no verdict, B: {failed} of 6 requests failed" in body["headline"]
    assert "--resume" in res.stderr
    assert f"**Failed requests:** B: {failed} of 6" in (tmp_path / "ab" / "report.md").read_text()


def test_all_of_b_failing_is_a_target_failure_not_bad_usage(scripted_server, tmp_path, compare):
    a = scripted_server(window=100_000)
    b = scripted_server(window=100_000, fail_every=1)  # answers /v1/models, fails every chat with 500
    res = compare(a, b, tmp_path / "ab", "--trials", "1", "--retry-budget", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "target failed: no case was scored on both sides (B: 6 of 6 requests failed" in res.stderr


def test_a_dead_b_is_named_by_its_flag(scripted_server, tmp_path, compare):
    a = scripted_server(window=100_000)
    res = compare(a, "http://127.0.0.1:9", tmp_path / "ab", "--trials", "1")
    assert res.returncode == 2
    assert "check --b" in res.stderr and "--base-url" not in res.stderr


def test_b_dying_after_the_comparisons_preflight_is_named_by_its_flag(scripted_server, tmp_path, compare):
    # B answers compare's own preflight chat, then dies on the next chat: its probe's preflight.
    a = scripted_server(window=100_000)
    b = scripted_server(window=100_000, die_after=1)
    res = compare(a, b, tmp_path / "ab", "--trials", "1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "cannot reach" in res.stderr and "check --b" in res.stderr, res.stderr
    assert "--base-url" not in res.stderr and "Traceback" not in res.stderr
    assert (tmp_path / "ab" / "a" / "results.sqlite").is_file()  # A was probed in between


def test_compare_refuses_a_probe_runs_folder(scripted_server, tmp_path, compare, cli):
    a = scripted_server(window=100_000)
    out = tmp_path / "run"
    probe = cli("probe", "--base-url", a, "--model", "scripted", *GRID, "--trials", "1", "--out", str(out))
    assert probe.returncode == 0, probe.stderr
    before = (out / "report.md").read_bytes()
    res = compare(a, a, out, "--trials", "1")
    assert res.returncode == 2
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: --out {out}: report.md was written by needlescope probe, not compare")
    )
    assert (out / "report.md").read_bytes() == before and not (out / "compare.json").exists()
