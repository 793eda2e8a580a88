"""``needlescope health`` and the canary's parts against real loopback servers.

The engine's ``/metrics`` is played by the scripted server extended with a ``/metrics`` route
whose body each test sets (SGLang, vLLM, needlescope serve or garbage); the organism test runs
the real ``needlescope serve``. The Prometheus end-to-end test is in test_watch_prometheus.py.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from needlescope.testing import scripted_server
from needlescope.testing.prometheus import free_port
from needlescope.testing.servers import in_thread
from needlescope.watch.canary import Canary, RollingWindow
from needlescope.watch.config import CanaryConfig
from needlescope.watch.engine import UnexpectedFormat, engine_metric_names, normalize
from needlescope.watch.gpu import GpuCollector, NoNvml
from needlescope.watch.health import HEALTH_SCHEMA
from needlescope.watch.metrics import CanaryMetrics, exported_names
from needlescope.watch.probe import build_probe_cases

ROOT = Path(__file__).resolve().parents[1]
CLI = (sys.executable, "-m", "needlescope.cli.main")

SGLANG = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0"} 5.0
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="1"} 3.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0"} 0.25
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="1"} 0.5
"""
VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.875
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 123.0
"""
NEEDLESCOPE = """# TYPE needlescope_serve_queue_depth gauge
needlescope_serve_queue_depth 6.0
# TYPE needlescope_serve_running_requests gauge
needlescope_serve_running_requests 8.0
"""


@pytest.fixture
def engine():
    """A scripted server (300-word recall window) that also serves ``/metrics``: set ``.body``."""

    class Handler(scripted_server.Handler):
        body = ""

        def do_GET(self) -> None:
            if self.path != "/metrics":
                return super().do_GET()
            data = Handler.body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    opts = scripted_server.parse_options(["--window", "300"])
    Handler.state = scripted_server.State(opts)
    with in_thread(Handler) as Handler.url:
        yield Handler


def samples(metrics: CanaryMetrics) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.values()))] = s.value
    return out


def run_rounds(cfg: CanaryConfig, rounds: int = 1, between=None) -> dict[tuple, float]:
    metrics = CanaryMetrics(cfg.lengths, gpu=GpuCollector(nvml=NoNvml))

    async def go() -> None:
        canary = Canary(cfg, metrics)
        try:
            for i in range(rounds):
                await canary.round()
                if between is not None:
                    between(i)
        finally:
            await canary.aclose()

    asyncio.run(go())
    return samples(metrics)


def canary_cfg(url: str, **kw) -> CanaryConfig:
    kw = {"lengths": (200, 600), "depths": (0.0, 25.0), "trials": 1, "timeout_s": 5.0, **kw}
    return CanaryConfig(base_url=url, **kw)


# --- engine metrics ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, engine_name, queue, running, kv",
    [
        (SGLANG, "sglang", 8.0, 2.0, 0.5),
        (VLLM, "vllm", 4.0, 7.0, 0.875),
        (NEEDLESCOPE, "needlescope", 6.0, 8.0, None),
    ],
)
def test_engine_metrics_of_each_engine_are_normalized(engine, body, engine_name, queue, running, kv):
    load = normalize(body)
    assert (load.engine, load.queue_depth, load.running, load.kv_cache_usage) == (
        engine_name,
        queue,
        running,
        kv,
    )
    engine.body = body
    got = run_rounds(canary_cfg(engine.url))
    assert got[("needlescope_engine_queue_depth",)] == queue
    assert got[("needlescope_engine_running_requests",)] == running
    assert (
        math.isnan(got[("needlescope_engine_kv_cache_usage_ratio",)])
        if kv is None
        else (got[("needlescope_engine_kv_cache_usage_ratio",)] == kv)
    )


@pytest.mark.parametrize(
    "body", ["<html><body>metrics</body></html>", '{"queue": 3}', "unrelated_metric 1\n"]
)
def test_unexpected_engine_metrics_warn_and_the_canary_goes_on(engine, body, caplog):
    with pytest.raises(UnexpectedFormat):
        normalize(body)
    engine.body = body
    with caplog.at_level(logging.WARNING, logger="needlescope.watch"):
        got = run_rounds(canary_cfg(engine.url), rounds=2)
    warnings = [r.getMessage() for r in caplog.records if "ignoring engine metrics" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # said once, not every round
    assert math.isnan(got[("needlescope_engine_queue_depth",)])
    assert got[("needlescope_recall", "200")] == 1.0 and got[("needlescope_recall", "600")] == 0.0
    assert got[("needlescope_target_up",)] == 1.0


def test_a_queue_sitting_at_its_admission_limit_is_flagged(engine, caplog):
    engine.body = SGLANG  # 8 waiting
    with caplog.at_level(logging.WARNING, logger="needlescope.watch"):
        got = run_rounds(canary_cfg(engine.url, queue_limit=8), rounds=2)
    assert got[("needlescope_engine_queue_limit",)] == 8.0
    assert got[("needlescope_engine_queue_at_limit",)] == 1.0
    assert "sat at its admission limit (8) for 2 scrapes" in caplog.text
    caplog.clear()
    got = run_rounds(canary_cfg(engine.url, queue_limit=9), rounds=2)
    assert got[("needlescope_engine_queue_at_limit",)] == 0.0
    assert "admission limit" not in caplog.text


# --- the canary's own behaviour -----------------------------------------------------------------


def test_rolling_window_is_bounded_and_gives_the_probe_effective_length():
    w = RollingWindow((100, 200, 400), size=3)
    assert math.isnan(w.effective_length(0.85)) and math.isnan(w.recall(100))
    for _ in range(50):
        w.add(100, True)
        w.add(200, True)
        w.add(400, False)
    assert [len(w._hits[n]) for n in (100, 200, 400)] == [3, 3, 3]
    assert (w.recall(100), w.recall(400), w.effective_length(0.85)) == (1.0, 0.0, 200.0)
    w.add(100, False)  # 2 of 3 at the shortest length: nothing passes 0.85
    assert w.effective_length(0.85) == 0.0


def test_target_errors_are_counted_by_kind_never_as_misses(scripted_server):
    url = scripted_server(window=300, fail_every=2, fail_status=503)
    got = run_rounds(canary_cfg(url, lengths=(200,), depths=(0.0,)), rounds=4)
    assert got[("needlescope_probe_errors_total", "admission")] == 2.0
    assert got[("needlescope_probes_total", "200", "hit")] == 2.0
    assert got[("needlescope_probes_total", "200", "miss")] == 0.0
    assert got[("needlescope_recall", "200")] == 1.0
    url = scripted_server(window=300, garbage_every=1)
    got = run_rounds(canary_cfg(url, lengths=(200,), depths=(0.0,)), rounds=2)
    assert got[("needlescope_probe_errors_total", "protocol")] == 2.0
    assert math.isnan(got[("needlescope_recall", "200")])


def test_a_canary_started_before_its_target_waits_for_it(scripted_server):
    port = free_port()
    cfg = canary_cfg(f"http://127.0.0.1:{port}", lengths=(200,), depths=(0.0,))
    started = []

    def start_target(i: int) -> None:
        if i == 1:
            started.append(scripted_server(window=300, port=port))

    got = run_rounds(cfg, rounds=3, between=start_target)
    assert started and got[("needlescope_probe_errors_total", "connection")] == 2.0
    assert got[("needlescope_target_up",)] == 1.0
    assert got[("needlescope_recall", "200")] == 1.0


def test_logs_hold_no_api_key_and_no_request_body_at_info(scripted_server, caplog):
    url = scripted_server(window=300)
    key = "sk-canary-SECRET-7731"
    cfg = canary_cfg(url, api_key=key)
    assert key not in repr(cfg)
    with caplog.at_level(logging.DEBUG):
        got = run_rounds(cfg, rounds=2)
    assert got[("needlescope_recall", "200")] == 1.0
    assert key not in caplog.text
    cases = build_probe_cases(
        cfg, url, "scripted", lengths=cfg.lengths, depths=cfg.depths, trials=1, value_digits=7
    )
    info = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "is up" in info
    for case in cases:
        assert case.needle not in info and case.question not in info
        assert not any(v in info for v in case.expected)


@pytest.fixture
def recording_engine():
    """An in-process scripted server (300-word recall window) that keeps every chat body it got."""

    class Handler(scripted_server.Handler):
        chats: list[dict] = []

        def _chat(self, body: dict) -> None:
            Handler.chats.append(body)
            super()._chat(body)

    Handler.state = scripted_server.State(scripted_server.parse_options(["--window", "300"]))
    with in_thread(Handler) as Handler.url:
        yield Handler


def test_every_probe_is_a_fresh_haystack_and_every_round_logs_its_recall(recording_engine, caplog):
    """Issue 38 item 13: the canary cycled a fixed set of cases, so from the third round on an
    engine's prefix cache could answer a probe from an earlier one; and it logged no recall, so a
    run against a broken server said only "target is up" and "canary stopped". Now no two probes
    share their opening words, and each round logs each length's result and rolling recall."""
    cfg = canary_cfg(recording_engine.url, lengths=(200, 600), depths=(0.0, 25.0))
    with caplog.at_level(logging.INFO, logger="needlescope.watch"):
        run_rounds(cfg, rounds=3)
    # The haystack's opening words, after the fixed instruction that leads every prompt.
    openings = [
        tuple(chat["messages"][0]["content"].split("\n\n", 1)[1].split()[:12])
        for chat in recording_engine.chats
    ]
    assert len(openings) == 6 and len(set(openings)) == 6, openings
    rounds = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert rounds[0] == (
        "round 1: 200 tokens hit (recall 1.00), 600 tokens miss (recall 0.00); effective length 200"
    ), rounds
    assert [line.split(":")[0] for line in rounds] == ["round 1", "round 2", "round 3"]


def test_a_round_logs_the_errors_of_its_probes(scripted_server, caplog):
    url = scripted_server(window=300, fail_every=1, fail_status=503)
    with caplog.at_level(logging.INFO, logger="needlescope.watch"):
        run_rounds(canary_cfg(url, lengths=(200,), depths=(0.0,)), rounds=1)
    rounds = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert rounds == ["round 1: 200 tokens admission (recall -); effective length -"], rounds


# --- GPUs -----------------------------------------------------------------------------------------


class FakeNvml:
    """Two GPUs; the second has no power reading, as some boards report NotSupported."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        return None

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h):
        return argparse.Namespace(gpu=[37, 90][h], memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return argparse.Namespace(used=[1 << 30, 2 << 30][h], total=141 << 30, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise self.NVMLError("Not Supported")
        return 312_500

    def nvmlDeviceGetTemperature(self, h, sensor):
        return [41, 55][h]


def test_gpu_gauges_come_from_nvml_per_gpu():
    m = CanaryMetrics((100,), gpu=GpuCollector(nvml=FakeNvml()))
    got = samples(m)
    assert got[("needlescope_gpu_devices",)] == 2.0
    assert got[("needlescope_gpu_utilization_ratio", "0", "NVIDIA H200")] == 0.37
    assert got[("needlescope_gpu_memory_used_bytes", "1", "NVIDIA H200")] == float(2 << 30)
    assert got[("needlescope_gpu_power_watts", "0", "NVIDIA H200")] == 312.5
    assert ("needlescope_gpu_power_watts", "1", "NVIDIA H200") not in got  # not supported: no series
    assert got[("needlescope_gpu_temperature_celsius", "1", "NVIDIA H200")] == 55.0


def test_without_nvml_the_gpu_gauges_degrade_to_zero_devices(health):
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError("NVML Shared Library Not Found")

    gpu = GpuCollector(nvml=Broken())
    got = samples(CanaryMetrics((100,), gpu=gpu))
    assert got[("needlescope_gpu_devices",)] == 0.0
    assert not any(k[0].startswith("needlescope_gpu_") and k[0] != "needlescope_gpu_devices" for k in got)
    assert "NVML Shared Library Not Found" in gpu.reason


# --- health ------------------------------------------------------------------------------------


@pytest.fixture
def health(run_cli_completed):
    """``needlescope health ARGS`` through the real entry point, in this process."""
    return functools.partial(run_cli_completed, "health")


def test_health_reports_each_check_and_exits_by_verdict(scripted_server, health):
    url = scripted_server(window=300)
    ok = health("--base-url", url + "/v1", "--length", "200")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines[:3]] == [["ok", "server"], ["warn", "chat"], ["ok", "needle"]]
    assert all(re.search(r"\d+ ms", ln) for ln in lines[:3])
    assert "does not follow this instruction" in lines[1]  # answered, so up: not a failure

    missed = health("--base-url", url, "--length", "600", "--depth", "0", "--json")
    assert missed.returncode == 1
    report = json.loads(missed.stdout)
    from needlescope.schema import check_schema

    check_schema(report, HEALTH_SCHEMA, "health")
    assert [c["status"] for c in report["checks"]] == ["ok", "warn", "fail"]
    assert report["checks"][2]["detail"] == "missed the needle at 600 tokens, depth 0%, a 7-digit value"
    assert (
        report["value_digits"] == 7 and "advertises no trained_value_digits" in report["value_digits_source"]
    )

    dead = f"http://127.0.0.1:{free_port()}"
    down = health("--base-url", dead, "--json")
    assert down.returncode == 1
    assert [c["status"] for c in json.loads(down.stdout)["checks"]] == ["fail", "skip", "skip"]

    failing = health(
        "--base-url", scripted_server(window=300, fail_every=1, fail_status=500), "--length", "200"
    )
    assert failing.returncode == 1 and failing.stdout.splitlines()[1].startswith("fail  chat")


def test_health_with_a_model_the_server_does_not_serve_is_bad_usage(scripted_server, health):
    """Issue 38 item 3: before, a typo in --model was blamed on the server ("exposes no /tokenize
    endpoint", exit 1, unhealthy); it is the caller's mistake: one line naming the served models,
    exit 2, as the probe says it."""
    url = scripted_server(window=300)
    typo = health("--base-url", url, "--model", "scriptd", "--length", "200")
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert typo.stderr.strip().splitlines() == [
        f"error: model 'scriptd' not served at {url}/v1; available: scripted"
    ], typo.stderr
    canary = subprocess.run(
        [*CLI, "canary", "--base-url", url, "--model", "scriptd", "--rounds", "1", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert canary.returncode == 2 and "error: model 'scriptd' not served" in canary.stderr, canary.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["health", "--base-url", "localhost:8000"], "is not an http(s) URL"),
        (["health", "--base-url", "http://127.0.0.1:1", "--depth", "120"], "--depth must be a percentage"),
        (["canary", "--base-url", "http://127.0.0.1:1", "--listen", "127.0.0.1"], "is not HOST:PORT"),
        (["canary", "--base-url", "http://127.0.0.1:1", "--listen", "127.0.0.1:70000"], "is not HOST:PORT"),
        (
            ["canary", "--base-url", "http://127.0.0.1:1", "--listen", "no-such-host.invalid:9464"],
            "cannot listen on",
        ),
        (["canary", "--base-url", "http://127.0.0.1:1", "--listen", "192.0.2.1:9464"], "cannot listen on"),
        (["canary", "--base-url", "http://127.0.0.1:1", "--interval", "0"], "--interval must be a positive"),
        (
            ["canary", "--base-url", "http://127.0.0.1:1", "--lengths", "2k"],
            "--lengths takes comma-separated",
        ),
        # issue 38 R18: accepted before (a negative count ran for ever; a key no header can carry
        # ended in a traceback from the HTTP client)
        (["canary", "--base-url", "http://127.0.0.1:1", "--rounds", "-1"], "--rounds must be 0"),
        (["health", "--base-url", "http://127.0.0.1:1", "--api-key", "sk-kéy"], "non-ASCII character"),
        (
            ["canary", "--base-url", "http://127.0.0.1:1", "--rounds", "1", "--api-key", "a\nb"],
            "control character",
        ),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(run_cli, args, message):
    code, out, err = run_cli(*args)
    assert code == 2, out + err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_port_in_use_is_one_line_and_exit_2(run_cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, err = run_cli(
            "canary", "--base-url", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}"
        )
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert len(err.strip().splitlines()) == 1


# --- against the organism ----------------------------------------------------------------------


def test_health_and_canary_watch_the_organism_and_its_admission_queue(health):
    from needlescope.serve.launch import ServerProcess

    args = ["--model", "organism", "--port", "0", "--max-running-requests", "1", "--max-queued-requests", "1"]
    with ServerProcess(args) as srv:
        # No flags: the needle's value length is the one the organism advertises (3 digits).
        ok = health("--base-url", srv.url + "/v1")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.splitlines()[2].startswith("ok    needle")
        assert "needle values: 3 digits, from the target's /get_server_info trained_value_digits" in ok.stdout

        cfg = CanaryConfig(base_url=srv.url, lengths=(256,), depths=(50.0,), trials=1)
        got = run_rounds(cfg)
        assert got[("needlescope_recall", "256")] == 1.0
        assert got[("needlescope_engine_queue_depth",)] == 0.0
        assert got[("needlescope_engine_queue_limit",)] == 1.0  # from /get_server_info
        assert got[("needlescope_engine_queue_at_limit",)] == 0.0
        assert got[("needlescope_probe_latency_seconds_count", "ttft")] == 1.0  # it streams

        # Fill the server: one request runs, one waits, the rest are refused with 503.
        stop = threading.Event()
        prompt = [
            {"role": "user", "content": "the river ran past the old mill and the baker sold bread " * 3}
        ]

        def flood() -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    body = {"model": "organism", "messages": prompt, "max_tokens": 8}
                    c.post(srv.url + "/v1/chat/completions", json=body)

        floods = [threading.Thread(target=flood, daemon=True) for _ in range(3)]
        for t in floods:
            t.start()
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/metrics").text.count("needlescope_serve_queue_depth 1.0") == 0:
            assert time.monotonic() < deadline, "the flood never filled the queue"
            time.sleep(0.05)
        # The gauge is a snapshot taken at the start of a round, and the flood's queue empties for
        # a moment each time a request finishes, so a round can see it full and still have its
        # probe admitted (a clean-clone run did): up to ten rounds, until one snapshot sees it full
        # and one probe has been refused.
        at_limit, admission = [], 0.0
        try:
            while len(at_limit) < 10 and (1.0 not in at_limit or admission < 1.0):
                got = run_rounds(cfg)
                at_limit.append(got[("needlescope_engine_queue_at_limit",)])
                admission += got[("needlescope_probe_errors_total", "admission")]
        finally:
            stop.set()
            for t in floods:
                t.join(timeout=60)
        assert 1.0 in at_limit, at_limit
        assert admission >= 1.0


# --- dashboards and config ---------------------------------------------------------------------

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (labels, ranges, strings and functions removed)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end() :].lstrip()
        if not rest.startswith("(") and m.group() not in _PROMQL_WORDS:
            names.add(m.group())
    return names


def dashboard_queries(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def test_grafana_dashboard_queries_only_exported_metrics_and_loads_as_a_dashboard():
    dash = json.loads((ROOT / "deploy/grafana/needlescope.json").read_text())
    known = exported_names() | engine_metric_names() | {"up"}
    queries = dashboard_queries(dash)
    assert queries and all(metric_names(q) for q in queries)
    unknown = {n for q in queries for n in metric_names(q)} - known
    assert not unknown, f"dashboard queries metrics nobody exports: {unknown}"
    # The checker itself catches a typo.
    assert metric_names("sum by (kind) (rate(needlescope_probe_error_total[5m]))") == {
        "needlescope_probe_error_total"
    }
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("recall", "effective", "latency", "errors", "queue", "gpu"):
        assert topic in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))

    gf = pytest.importorskip("grafana_foundation_sdk.models.dashboard")  # needs Python >= 3.11
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import prometheus as gf_prometheus

    register_default_plugins()  # panel and query kinds, as Grafana's own loader knows them
    model = gf.Dashboard.from_json(dash)
    assert model.title == dash["title"] and model.schema_version == dash["schemaVersion"]
    panels = [p for p in model.panels if isinstance(p, gf.Panel)]
    assert len(panels) == len(queries) - sum(
        len(p["targets"]) - 1 for p in dash["panels"] if p["type"] != "row"
    )
    for panel in panels:
        assert panel.grid_pos is not None and panel.grid_pos.w > 0
        assert panel.targets and all(isinstance(t, gf_prometheus.Dataquery) for t in panel.targets)
        assert all(t.expr for t in panel.targets)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs Debian's prometheus (make deps)")
def test_prometheus_config_and_canary_exposition_pass_promtool(tmp_path):
    for cmd in (["check", "config", "prometheus.yml"], ["check", "rules", "needlescope-alerts.yml"]):
        done = subprocess.run(
            ["promtool", *cmd], cwd=ROOT / "deploy/prometheus", capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
    m = CanaryMetrics((2000, 8000), gpu=GpuCollector(nvml=FakeNvml()))
    m.recall.labels("2000").set(1.0)
    lint = subprocess.run(["promtool", "check", "metrics"], input=m.render(), capture_output=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_sigterm_abandons_the_probe_in_flight_and_exits_0(scripted_server):
    url = scripted_server(window=300, slow_every=1, slow_s=60)
    canary = subprocess.Popen(
        [
            *CLI,
            "canary",
            "--base-url",
            url,
            "--lengths",
            "200",
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "debug",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert canary.stdout.readline().startswith("READY ")
        for line in canary.stderr:  # the cases are built: the next request is the 60 s probe
            if "probe cases" in line or "canary stopped" in line:
                break
        canary.terminate()
        assert canary.wait(timeout=20) == 0  # well before the probe would have answered
        assert "canary stopped" in canary.stderr.read()
    finally:
        canary.kill()
        canary.wait()


def test_watch_is_core_and_imports_no_torch():
    code = (
        "import sys, needlescope.watch.canary, needlescope.watch.health, needlescope.cli.watch; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def sse(*chunks: object, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


@pytest.fixture(scope="module")
def stream_server():
    """A loopback server whose chat answer is the SSE bytes in ``.stream``, sent in 7-byte pieces
    (lines split across reads as on any socket), then the connection closes."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        stream = b""

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(0, len(Handler.stream), 7):
                self.wfile.write(Handler.stream[i : i + 7])
                self.wfile.flush()
            self.close_connection = True

    with in_thread(Handler) as root:
        Handler.url = root + "/v1"
        yield Handler


@pytest.mark.parametrize(
    "stream, expected",
    [
        (
            sse({"choices": [{"delta": {"content": "4173"}}]}, {"choices": [{"delta": {"content": "559"}}]}),
            "hit",
        ),
        (sse({"choices": [{"delta": {"content": "12"}}]}, {"error": {"message": "engine died"}}), "protocol"),
        (sse({"usage": {"prompt_tokens": 3}}), "protocol"),
        (b"data: {not json\n\n", "protocol"),
        # issue 38 R9: cut off with neither a finish_reason nor [DONE] (a miss before); a stream
        # that says why it finished needs no [DONE] to be scored
        (sse({"choices": [{"delta": {"content": "12"}}]}, done=False), "protocol"),
        (sse({"choices": [{"delta": {"content": "9"}, "finish_reason": "stop"}]}, done=False), "miss"),
    ],
)
def test_streamed_answers_are_assembled_and_broken_streams_are_errors(stream_server, stream, expected):
    from needlescope.cases import Case
    from needlescope.targets import ChatTarget
    from needlescope.watch.probe import RecordingTransport, probe_case

    stream_server.stream = stream
    case = Case("c", "single", 10, 0.0, 0, [{"role": "user", "content": "q"}], ["4173559"], "q", "n", "g", 10)

    async def go():
        recorder = RecordingTransport()
        async with ChatTarget(
            stream_server.url, "m", retries=0, retry_budget_s=0, transport=recorder
        ) as target:
            return await probe_case(target, recorder, case, max_tokens=8, extra_body={})

    outcome = asyncio.run(go())
    assert (outcome.error or outcome.detail) == expected, outcome
    assert (outcome.ttft_s is not None) == (expected != "protocol" or stream.startswith(b'data: {"choices"'))
