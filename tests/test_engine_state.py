"""``needlescope engine-state`` against real loopback servers: the organism with a prefix cache
(the cache factor, and a SIGKILL mid-run then ``--resume``), the scripted server (no logprobs,
failing and slow requests, a restart between a cold send and its warm one)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from needlescope.report.engine_state import engine_state_markdown
from needlescope.run.engine_state import EngineStateConfig, run_engine_state
from needlescope.serve.launch import ServerProcess
from needlescope.testing.servers import scripted

CLI = [sys.executable, "-m", "needlescope.cli.main", "engine-state"]
SMALL = ["--lengths", "160", "--depths", "0,100", "--trials", "1"]


@pytest.fixture(scope="module")
def cached():
    """The shipped organism with a 16 MiB prefix cache; its /v1 URL."""
    with ServerProcess(["--model", "organism", "--port", "0", "--prefix-cache-mib", "16"]) as srv:
        yield srv.url + "/v1"


@pytest.fixture
def cli(run_cli):
    """``needlescope engine-state ARGS`` through the real entry point, in this process: (code, out, err)."""
    return lambda *args: run_cli("engine-state", *args)


def _sends(out) -> dict[tuple[str, str, str], tuple[str, float]]:
    with sqlite3.connect(out / "results.sqlite") as db:
        rows = db.execute("SELECT factor, arm, case_id, status, finished_at FROM sends").fetchall()
    return {(f, a, c): (s, t) for f, a, c, s, t in rows}


def test_cache_factor_shows_cached_tokens_in_the_warm_arm_only(cached, tmp_path, cli):
    code, out, err = cli(
        "--base-url", cached, "--model", "organism", "--out", str(tmp_path), "--factors", "cache,repeat",
        *SMALL, "--repeats", "2",
    )  # fmt: skip
    assert code == 0, err
    body = json.loads((tmp_path / "engine_state.json").read_text())
    cache = body["factors"]["cache"]["effect"]
    cold, warm = body["factors"]["cache"]["rows"]
    assert cache["pairs"] == 2 and [r["cached_tokens"] for r in cold] == [0, 0]
    assert all(r["cached_tokens"] == 128 for r in warm)  # the 128-token boundary below ~170 tokens
    assert cache["answers_differ"] == 0 and cache["recall_delta"] == 0.0
    right = [r for r in cold if r["correct"]]
    assert right and (cache["margin"]["n"], cache["margin"]["delta_mean"]) == (len(right), 0.0)
    assert all((r["margin"] is not None and r["margin"] > 0) == r["correct"] for r in cold)
    assert body["factors"]["repeat"]["effect"]["determinism_rate"] == 1.0
    again = EngineStateConfig(
        cached, "organism", factors=("cache",), lengths=(160,), depths=(0.0, 100.0), trials=1
    )
    cold_again, warm_again = run_engine_state(again, tmp_path / "again")["factors"]["cache"]["rows"]
    assert [r["cached_tokens"] for r in cold_again] == [0, 0]  # a new run: fresh nonces, cold again
    assert [r["cached_tokens"] for r in warm_again] == [128, 128]
    assert "| cache | cold vs warm | 2 |" in out


def test_sigkill_mid_run_then_resume_loses_and_duplicates_nothing(cached, tmp_path, cli):
    flags = [
        "--base-url", cached, "--model", "organism", "--out", str(tmp_path), "--lengths", "160",
        "--depths", "0,50,100", "--trials", "2", "--repeats", "2", "--concurrency", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [*CLI, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    db = tmp_path / "results.sqlite"
    before: dict = {}
    deadline = time.time() + 60
    while time.time() < deadline and len(before) < 9 and proc.poll() is None:
        time.sleep(0.02)
        if db.exists():
            try:
                before = _sends(tmp_path)
            except sqlite3.Error:  # the table is made a moment after the file
                before = {}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _sends(tmp_path)
    # 6 cases: cache 2 arms, concurrency 2, repeat 2 -> 36 scored sends; killed part-way.
    assert 9 <= len(before) < 36, len(before)
    code, _, err = cli(*flags)
    assert code == 2 and "already holds a run; pass --resume" in err
    code, _, err = cli(*flags, "--trials", "1", "--resume")
    assert code == 2 and "--resume: the run in" in err and "trials=2, not 1" in err
    code, out, err = cli(*flags, "--resume")
    assert code == 0, err
    after = _sends(tmp_path)
    assert len(after) == 36 and all(status == "ok" for status, _ in after.values())
    kept = {k: v for k, v in before.items() if v[0] == "ok"}
    assert {k: after[k] for k in kept} == kept  # finished sends were not sent again
    body = json.loads((tmp_path / "engine_state.json").read_text())
    for name, factor in body["factors"].items():
        assert factor["effect"]["pairs"] == 6 and factor["effect"]["errors"] == 0, name
        for rows in factor["rows"]:
            assert (
                sorted(r["case_id"] for r in rows) == sorted({r["case_id"] for r in rows}) and len(rows) == 6
            )
    cold, warm = body["factors"]["cache"]["rows"]
    assert [r["nonce"] for r in cold] == [r["nonce"] for r in warm]
    assert all(w["cached_tokens"] > c["cached_tokens"] for c, w in zip(cold, warm, strict=True))


def _drop_warm(out, case_id: str) -> None:
    """A kill between a cold send and its warm one, made exact: the warm row is gone."""
    with sqlite3.connect(out / "results.sqlite") as db:
        db.execute("DELETE FROM sends WHERE factor = 'cache' AND arm = 'warm' AND case_id = ?", (case_id,))


def test_a_warm_send_resumed_on_a_restarted_server_resends_the_pair(tmp_path):
    def cfg(url: str) -> EngineStateConfig:
        return EngineStateConfig(
            url, "organism", factors=("cache",), lengths=(200,), depths=(0.0, 100.0), trials=1
        )

    with scripted(model="organism") as srv:
        first = run_engine_state(cfg(srv.url), tmp_path)["factors"]["cache"]
        case = first["rows"][0][0]["case_id"]
        _drop_warm(tmp_path, case)
        same = run_engine_state(cfg(srv.url), tmp_path, resume=True)["factors"]["cache"]  # prefix still kept
    assert same["resume"] == {"warm_kept": 1, "pairs_resent": 0}
    assert same["rows"][0][0] == first["rows"][0][0] and same["rows"][1][0]["nonce"] == _nonce(first)
    _drop_warm(tmp_path, case)
    with scripted(model="organism") as srv:  # a restarted server: its prefix cache is empty
        body = run_engine_state(cfg(srv.url), tmp_path, resume=True)
    resent = body["factors"]["cache"]
    assert resent["resume"] == {"warm_kept": 1, "pairs_resent": 1}
    assert "Resumed: 1 warm send(s) continued" in engine_state_markdown(body)
    cold, warm = resent["rows"][0][0], resent["rows"][1][0]
    assert cold["nonce"] == warm["nonce"] != _nonce(first)  # a fresh nonce for the new pair
    # The scripted cache shares the template's first word with earlier prompts: cold is not 0,
    # which is why a resumed warm send must beat its cold one, not merely be above 0.
    assert 0 < cold["cached_tokens"] < warm["cached_tokens"]
    assert resent["rows"][0][1] == first["rows"][0][1]  # the other case untouched
    assert resent["effect"]["pairs"] == 2


def _nonce(factor: dict) -> str:
    """The first case's cold nonce."""
    return factor["rows"][0][0]["nonce"]


def test_failing_and_slow_requests_are_errors_then_resume_retries_them(tmp_path, cli):
    flags = ["--model", "organism", "--out", str(tmp_path), "--lengths", "200", "--depths", "0,50,100"]
    flags += ["--trials", "2", "--repeats", "2", "--concurrency", "2", "--timeout", "0.5"]
    with scripted(model="organism", fail_every=4, slow_every=7, slow_s=2) as srv:
        code, out, err = cli("--base-url", srv.url, *flags)
    assert code == 0, err
    body = json.loads((tmp_path / "engine_state.json").read_text())
    kinds = set()
    for name, factor in body["factors"].items():
        a, b = factor["rows"]
        failed = [x for x, y in zip(a, b, strict=True) if x["error"] or y["error"]]
        assert factor["effect"]["errors"] == len(failed) and factor["effect"]["pairs"] == 6 - len(failed), (
            name
        )
        for row in a + b:
            assert (row["error"] is None) == (row["correct"] is not None)  # an error is never a miss
            if row["error"]:
                kinds.add(row["error"].split(":")[0])
        assert factor["effect"]["recall_a"] == 1.0 and factor["effect"]["recall_b"] == 1.0, name
    assert {"protocol", "timeout"} <= kinds  # HTTP 500s and whole-request timeouts (targets.bounded)
    assert "failed on the target (errors, not misses)" in err
    warm_up = {n: f["warm_up_errors"] for n, f in body["factors"].items() if n != "cache"}
    assert sum(warm_up.values()) > 0 and "Failed warm-up sends" in out  # every 4th chat fails, warm-ups too
    with scripted(model="organism") as srv:
        code, _, err = cli("--base-url", srv.url, *flags, "--resume")
    assert code == 0, err
    body = json.loads((tmp_path / "engine_state.json").read_text())
    assert all(f["effect"]["errors"] == 0 and f["effect"]["pairs"] == 6 for f in body["factors"].values())


def test_without_logprobs_recall_is_scored_and_margins_are_none(tmp_path):
    with scripted(model="organism") as srv:
        cfg = EngineStateConfig(
            srv.url, "organism", factors=("cache",), lengths=(200,), depths=(50.0,), trials=2
        )
        effect = run_engine_state(cfg, tmp_path)["factors"]["cache"]["effect"]
    assert (effect["pairs"], effect["recall_a"], effect["recall_b"]) == (2, 1.0, 1.0)
    assert effect["margin"]["n"] == 0 and effect["cached_tokens_b"] is not None


def test_bad_input_exits_2_before_any_request(cli, tmp_path):
    dead = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m"]  # nothing listens on :9
    code, _, err = cli(*dead, "--out", str(tmp_path / "a"), "--factors", "cache,batch")
    assert code == 2 and "factors must be among cache, concurrency, repeat" in err
    code, _, err = cli(*dead, "--out", str(tmp_path / "b"), "--depths", "150")
    assert code == 2 and "depths must be percentages in 0..100" in err
    code, _, err = cli(*dead, "--out", str(tmp_path / "c"), "--resume")
    assert code == 2 and "holds no run to continue" in err
    assert not any(tmp_path.iterdir())
