"""``needlescope health`` / ``canary`` and the shipped alert rules, tried as an outsider would:
a peer whose model list is odd, a canary killed outright, a canary run on a long interval, a
first round that takes its time, a server whose refusals never read the same twice.

Real parts only: loopback HTTP servers in this process, the real CLI (in-process, or a child
process where a live ``/metrics`` is scraped), and Debian's ``promtool`` evaluating the shipped
rule file over series shaped as Prometheus records them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from needlescope.testing import scripted_server
from needlescope.testing.servers import in_thread
from needlescope.watch.canary import Canary
from needlescope.watch.config import CanaryConfig
from needlescope.watch.gpu import GpuCollector, NoNvml
from needlescope.watch.metrics import CanaryMetrics

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy/prometheus/needlescope-alerts.yml"
CANARY = "needlescope-canary"  # the scrape job of deploy/prometheus/prometheus.yml

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs Debian's prometheus")


def _state(*flags: str) -> scripted_server.State:
    return scripted_server.State(scripted_server.parse_options(["--window", "300", *flags]))


# --- alert rules, evaluated by promtool -----------------------------------------------------------


def firing(alert: str = "", severity: str = "") -> str:
    """PromQL: how many alerts of the shipped rules fire (of one name, or one severity)."""
    sel = "".join(f', {k}="{v}"' for k, v in (("alertname", alert), ("severity", severity)) if v)
    return f'count(ALERTS{{alertstate="firing"{sel}}}) or vector(0)'


def promtool_rules(tmp_path: Path, series: dict[str, str], checks: dict[tuple[str, str], int]) -> str:
    """Run ``promtool test rules`` on the shipped rule file: ``series`` (selector -> promtool
    values, one sample a minute), ``checks`` ((PromQL, eval time) -> its value, e.g. how many
    alerts fire then). '' when every check held, else promtool's report."""
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": [
                    {"expr": expr, "eval_time": at, "exp_samples": [{"value": value}]}
                    for (expr, at), value in checks.items()
                ],
            }
        ],
    }
    path = tmp_path / "alerts_test.json"  # JSON is YAML
    path.write_text(json.dumps(test))
    done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def _canary(name: str, **labels: str) -> str:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return f'{name}{{job="{CANARY}", instance="127.0.0.1:9464"{extra}}}'


@needs_promtool
def test_a_killed_canary_pages(tmp_path):
    """Every rule read a series the canary exports. Killed (SIGKILL, OOM, a crash loop), the
    canary's series go stale in Prometheus and no rule could fire: production ran unwatched in
    silence, recall at 0.2 when it died. Prometheus's own ``up`` of the canary's job now pages."""
    killed_at_10m = {
        _canary("up"): "1x10 0x50",
        _canary("needlescope_target_up"): "1x10 stale",
        _canary("needlescope_recall", length_bucket="2000"): "0.2x10 stale",
        _canary("needlescope_last_success_timestamp_seconds"): "0+60x10 stale",
        _canary("needlescope_round_interval_seconds"): "60x10 stale",
    }
    checks = {(firing(severity="page"), "12m"): 0, (firing(severity="page"), "30m"): 1}
    report = promtool_rules(tmp_path, killed_at_10m, checks)
    assert not report, report


@needs_promtool
def test_no_scored_probe_waits_out_a_long_interval_and_still_fires_on_a_stall(tmp_path):
    """A canary run every 30 minutes (``--interval 1800``: 32K-token probes are not cheap)
    scores a probe every 30 minutes by design; the fixed 15-minute rule fired between every two
    rounds. The rule now waits three rounds (never less than 15 minutes), and still fires when a
    60-second canary stops scoring."""
    half_hourly = {
        # Unix time of the last scored probe: 0, then 1800 at 30m, 3600 at 60m.
        _canary("needlescope_last_success_timestamp_seconds"): "0x29 1800x29 3600x29",
        _canary("needlescope_round_interval_seconds"): "1800x89",
    }
    quiet = {(firing("NeedlescopeNoScoredProbe"), f"{m}m"): 0 for m in (26, 29, 56, 59, 86)}
    report = promtool_rules(tmp_path, half_hourly, quiet)
    assert not report, report

    stalled = {  # scored every minute, then nothing from 10m on
        _canary("needlescope_last_success_timestamp_seconds"): "0+60x10 600x50",
        _canary("needlescope_round_interval_seconds"): "60x60",
    }
    checks = {(firing("NeedlescopeNoScoredProbe"), "20m"): 0, (firing("NeedlescopeNoScoredProbe"), "35m"): 1}
    report = promtool_rules(tmp_path, stalled, checks)
    assert not report, report


# --- a live canary's /metrics -------------------------------------------------------------------


@pytest.fixture
def held_chat():
    """A scripted server (300-word window) whose chats wait until ``.release`` is set; ``.arrived``
    is set when the first one comes in. Stands for a first round of long probes on a busy server."""

    class Handler(scripted_server.Handler):
        arrived = threading.Event()
        release = threading.Event()

        def _chat(self, body: dict) -> None:
            Handler.arrived.set()
            Handler.release.wait(60)
            super()._chat(body)

    Handler.state = _state()
    with in_thread(Handler) as Handler.url:
        try:
            yield Handler
        finally:
            Handler.release.set()


def _alert_metric_names() -> set[str]:
    return set(re.findall(r"\bneedlescope_[a-z_]+", ALERTS.read_text())) - {"needlescope"}


def test_a_first_round_in_flight_is_not_target_down(held_chat):
    """``needlescope_target_up`` started at 0 and stayed there until the first round ended: a
    freshly (re)started canary read as "target down" on the dashboard while its first probe was
    being answered, and a first round longer than 5 minutes (three long probes on a loaded
    server, one at a time) paged NeedlescopeTargetDown. Unknown is NaN until a round ends. The
    scrape is of a real canary process, and every needlescope series the alert rules read is in it."""
    canary = subprocess.Popen(
        [sys.executable, "-m", "needlescope.cli.main", "canary", "--base-url", held_chat.url,
         "--lengths", "200", "--interval", "7", "--listen", "127.0.0.1:0", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = canary.stdout.readline()
        assert line.startswith("READY "), canary.stderr.read() if canary.poll() is not None else line
        assert held_chat.arrived.wait(60), "the canary never sent its probe"
        body = httpx.get(f"http://127.0.0.1:{int(line.split()[1])}/metrics", timeout=10).text
    finally:
        held_chat.release.set()
        canary.terminate()
        assert canary.wait(timeout=30) == 0
    got = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    assert math.isnan(got["needlescope_target_up"]), got["needlescope_target_up"]
    assert got["needlescope_round_interval_seconds"] == 7.0
    assert _alert_metric_names() <= set(got), _alert_metric_names() - set(got)


# --- health and canary against odd peers --------------------------------------------------------


@pytest.mark.parametrize("listed", [123, None, ""])
def test_a_model_list_with_an_id_that_is_no_name_is_no_model(run_cli, listed):
    """A ``/v1/models`` whose first id was 123 ended ``needlescope health`` in a traceback (its
    report's schema wants a string); one whose id was null sent ``"model": null`` and blamed the
    server for "model None not found". Neither lists a model: the report says so, exit 1."""

    class Handler(scripted_server.Handler):
        def do_GET(self) -> None:
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": listed, "object": "model"}]})
            return super().do_GET()

    Handler.state = _state()
    with in_thread(Handler) as url:
        code, out, err = run_cli("health", "--base-url", url, "--length", "200", "--json")
    assert code == 1, out + err
    report = json.loads(out)
    assert report["model"] is None
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        ("server", "ok"),
        ("chat", "fail"),
        ("needle", "fail"),
    ]
    assert "lists no model" in report["checks"][1]["detail"] and "None" not in report["checks"][1]["detail"]


def test_refusals_that_never_read_the_same_keep_the_canary_bounded(caplog):
    """Each distinct error reason was kept for ever to rate-limit its log line. A server whose
    refusals carry a changing number (OpenAI's 429 says "Used 29182 of 30000 tokens", others a
    request id) added an entry per failed probe for as long as the canary ran. Reasons not
    logged within the last minute are now forgotten. (The canary's injected clock moves a
    minute a round: no waiting.)"""

    class Handler(scripted_server.Handler):
        def _chat(self, body: dict) -> None:
            n = self.state.next_chat()
            self._send(503, {"error": {"message": f"queue full, request {n} refused"}})

    Handler.state = _state()
    rounds = 25
    now = [1_800_000_000.0]

    def clock() -> float:
        now[0] += 61.0
        return now[0]

    with in_thread(Handler) as url:
        cfg = CanaryConfig(base_url=url, lengths=(200,), depths=(0.0,), timeout_s=5.0)
        metrics = CanaryMetrics(cfg.lengths, gpu=GpuCollector(nvml=NoNvml))

        async def go() -> int:
            canary = Canary(cfg, metrics, clock=clock)
            try:
                for _ in range(rounds):
                    await canary.round()
                return len(canary._error_log)
            finally:
                await canary.aclose()

        with caplog.at_level(logging.WARNING, logger="needlescope.watch"):
            kept = asyncio.run(go())
    errors = [r.getMessage() for r in caplog.records if r.getMessage().startswith("probe error")]
    assert len(errors) == rounds and len(set(errors)) == rounds  # each reason still logged
    assert kept == 1, kept


def test_health_timeout_bounds_the_tokenize_requests_too(run_cli):
    """``health --timeout 1`` (a readiness probe's budget) against a server whose ``/tokenize``
    hangs waited a fixed 30 s per tokenize form it tried, a minute in all, and the probe that
    called it was killed first. ``--timeout`` now bounds those requests as it bounds the chat."""
    release = threading.Event()

    class Handler(scripted_server.Handler):
        def do_POST(self) -> None:
            if "tokenize" in self.path:
                release.wait(120)
                return
            super().do_POST()

    Handler.state = _state()
    with in_thread(Handler) as url:
        try:
            code, out, err = run_cli("health", "--base-url", url, "--length", "200", "--timeout", "1")
        finally:
            release.set()
    assert code == 1, out + err
    needle = out.splitlines()[2]
    assert needle.startswith("fail  needle") and "no answer within 1s" in needle, out


def test_a_tokenize_failing_mid_run_is_counted_and_logged_each_time(caplog):
    """Once the canary had its token counter, a ``/tokenize`` that failed (a 500, a timeout) left
    the round with no probe: one warning in the whole run and nothing counted, so a canary that
    measured nothing for hours showed no error on the dashboard and, after its first episode,
    none in the log. It is now a failed request of kind ``tokenize``, each episode logged."""
    broken = threading.Event()

    class Handler(scripted_server.Handler):
        def do_POST(self) -> None:
            if "tokenize" in self.path and broken.is_set():
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                return self._send(500, {"error": {"message": "tokenizer worker crashed"}})
            super().do_POST()

    Handler.state = _state()
    now = [1_800_000_000.0]

    def clock() -> float:  # a minute a call: each episode is past the log's rate limit
        now[0] += 61.0
        return now[0]

    with in_thread(Handler) as url:
        cfg = CanaryConfig(base_url=url, lengths=(200,), depths=(0.0,), timeout_s=5.0)
        metrics = CanaryMetrics(cfg.lengths, gpu=GpuCollector(nvml=NoNvml))

        async def go() -> None:
            canary = Canary(cfg, metrics, clock=clock)
            try:
                for episode in ("ok", "broken", "ok", "broken"):
                    (broken.set if episode == "broken" else broken.clear)()
                    await canary.round()
            finally:
                await canary.aclose()

        with caplog.at_level(logging.WARNING, logger="needlescope.watch"):
            asyncio.run(go())
    got = {
        (s.name, s.labels.get("kind"), s.labels.get("result")): s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }
    assert got[("needlescope_probe_errors_total", "tokenize", None)] == 2.0
    assert got[("needlescope_probes_total", None, "hit")] == 2.0
    lines = [r.getMessage() for r in caplog.records if "tokenizer worker crashed" in r.getMessage()]
    assert len(lines) == 2, lines
