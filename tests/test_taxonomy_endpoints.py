"""Failure taxonomy, reproducer bundles, replay and many endpoints, against real scripted servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from needlescope.report.probe import validate_summary


@pytest.fixture
def cli(run_cli_completed):
    """The real command through its entry point, in this process."""
    return run_cli_completed


def probe(cli, out: Path, *urls: str, kind: str = "single", extra: tuple[str, ...] = ()) -> dict:
    flags = [x for u in urls for x in ("--base-url", u)]
    grid = ["--lengths", "200,300", "--depths", "0,100", "--trials", "2", "--kind", kind]
    res = cli("probe", *flags, "--model", "scripted", "--out", str(out), *grid, *extra)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    validate_summary(summary)
    return summary


@pytest.mark.parametrize(
    ("fault", "kind", "category"),
    [
        ("distractor", "multikey", "distractor"),
        ("near_miss", "single", "near_miss"),
        ("partial", "single", "partial"),
        ("refusal", "single", "refusal"),
        ("empty", "single", "empty_or_length"),
        ("length", "single", "empty_or_length"),
        ("reasoning", "single", "reasoning_exhausted"),
    ],
)
def test_taxonomy_classifies_planted_failures(scripted_server, tmp_path, fault, kind, category, cli):
    url = scripted_server(fault=fault)
    summary = probe(cli, tmp_path, url, kind=kind)
    failures = summary["failures"]
    assert failures["misses"] == 8 and failures["counts"][category] == 8, failures["counts"]
    example = failures["examples"][category][0]
    if category == "distractor":
        assert example["distractor_depth"] is not None and example["value"] not in example["expected"]
    if category == "partial":
        assert example["first_wrong"] == 3
    if category == "near_miss":
        assert example["edit_distance"] == 1 and example["first_wrong"] == 6
    assert f"**{category}**" in (tmp_path / "report.md").read_text()


def test_errors_are_never_classified_as_misses(scripted_server, tmp_path, cli):
    url = scripted_server(fail_every=2, fail_status=500)
    summary = probe(cli, tmp_path, url, extra=("--timeout", "5"))
    assert summary["failures"]["misses"] == 0


def test_three_replicas_one_faulty_is_named(scripted_server, tmp_path, cli):
    healthy = [scripted_server(replica_id=f"r{i}") for i in range(2)]
    faulty = scripted_server(fault="near_miss", fault_rate=0.8, fault_seed=3, replica_id="r2")
    summary = probe(cli, tmp_path, *healthy, faulty, extra=("--trials", "8", "--concurrency", "3"))
    ep = summary["endpoints"]
    assert [e["name"] for e in ep["endpoints"]] == sorted(u + "/v1" for u in (*healthy, faulty))
    assert faulty + "/v1" in ep["differs"] and "r2" in ep["differs"]
    assert not any(u + "/v1" in ep["differs"] for u in healthy)
    assert {r["name"] for r in ep["replicas"]} == {"r0", "r1", "r2"}
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["base_url"] for r in rows} == {u + "/v1" for u in (*healthy, faulty)}


def test_endpoints_serving_different_models_are_refused(scripted_server, tmp_path, cli):
    a, b = scripted_server(), scripted_server(model="other")
    res = cli("probe", "--base-url", a, "--base-url", b, "--model", "scripted", "--out", str(tmp_path))
    assert res.returncode == 2 and "not served" in res.stderr
    c = scripted_server()
    ok = cli(
        "probe",
        "--base-url",
        a,
        "--base-url",
        c,
        "--model",
        "scripted",
        "--out",
        str(tmp_path / "x"),
        "--lengths",
        "200",
        "--depths",
        "0",
        "--trials",
        "1",
    )
    assert ok.returncode == 0, ok.stderr
    assert "per-replica attribution needs each replica's URL" in (tmp_path / "x" / "report.md").read_text()


def test_bundle_replays_against_faulty_and_not_healthy(scripted_server, tmp_path, cli):
    faulty = scripted_server(fault="near_miss", fault_from=250)
    healthy = scripted_server()
    probe(cli, tmp_path, faulty, extra=("--bundles", "2"))
    bundles = sorted((tmp_path / "bundles").iterdir())
    assert len(bundles) == 2
    bundle = bundles[0]
    request = json.loads((bundle / "request.json").read_text())
    assert request["model"] == "scripted" and request["temperature"] == 0 and request["messages"]
    for name in ("response.json", "case.json", "server_info.json", "manifest.json"):
        assert (bundle / name).is_file()
    assert json.loads((bundle / "case.json").read_text())["seed"] == 0
    bad = cli("replay", str(bundle), "--base-url", faulty, "--times", "3")
    assert bad.returncode == 0, bad.stderr
    assert "reproduced 3/3 times (near_miss 3; originally near_miss)" in bad.stdout
    good = cli("replay", str(bundle), "--base-url", healthy, "--times", "2")
    assert good.returncode == 0, good.stderr
    assert "did not reproduce: answered correctly 2/2 times" in good.stdout
    down = scripted_server(fail_every=1)  # every chat answers HTTP 500: nothing is measured
    blocked = cli("replay", str(bundle), "--base-url", down, "--times", "2")
    assert blocked.returncode == 1, blocked.stdout + blocked.stderr  # never 0, the healthy code
    assert "could not tell: all 2 request(s) failed" in blocked.stdout
    assert "target failed: none of 2 request(s)" in blocked.stderr and "Traceback" not in blocked.stderr
    missing = cli("replay", str(tmp_path / "nope"), "--base-url", healthy)
    assert missing.returncode == 2 and "not a bundle directory" in missing.stderr


def test_probe_bisect_cli(scripted_server, tmp_path, cli):
    url = scripted_server(fault="near_miss", fault_from=500)
    res = cli(
        "probe",
        "--bisect",
        "--base-url",
        url,
        "--model",
        "scripted",
        "--out",
        str(tmp_path),
        "--lengths",
        "200,900",
        "--depths",
        "0,100",
        "--trials",
        "1",
        "--resolution",
        "10",
        "--boundaries",
        "4,64",
    )
    assert res.returncode == 0, res.stderr
    assert "recall falls below 0.85 between" in res.stdout
    assert "coarse: coarse bracket; pass end" in res.stdout and "Fisher p=" in res.stdout
    out = json.loads((tmp_path / "bisect.json").read_text())
    assert out["last_pass"] < 500 <= out["collapse_length"] <= out["last_pass"] + 10
    none = cli(
        "probe",
        "--bisect",
        "--base-url",
        url,
        "--model",
        "scripted",
        "--out",
        str(tmp_path / "n"),
        "--lengths",
        "200,400",
        "--depths",
        "0",
        "--trials",
        "1",
        "--boundaries",
        "",
    )
    assert none.returncode == 2 and "cannot bracket a boundary in [200, 400]" in none.stdout
