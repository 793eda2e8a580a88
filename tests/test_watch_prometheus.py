"""The canary under a real Prometheus (Debian's ``prometheus``, ``make deps`` installs it).

Prometheus scrapes the canary (a real ``needlescope canary`` process) every second; the canary
watches the scripted server, whose recall window makes the expected values known: with a
300-word window, needles at depths 0 and 25 are found at 200 tokens and lost at 600. Everything
binds 127.0.0.1. Values are read back through Prometheus's HTTP query API.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from needlescope.testing.prometheus import PROMETHEUS, PrometheusServer, free_port, scripted_target

if PROMETHEUS is None and os.environ.get("CI"):
    pytest.fail("prometheus is not installed; `make deps` installs Debian's package", pytrace=False)
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (make deps)")

CANARY_ARGV = (sys.executable, "-m", "needlescope.cli.main", "canary")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def test_prometheus_sees_recall_and_up_through_an_outage(tmp_path, procs):
    target_port = free_port()
    procs.append(scripted_target(target_port, 300))
    canary = subprocess.Popen(
        [
            *CANARY_ARGV,
            "--base-url",
            f"http://127.0.0.1:{target_port}/v1",
            "--interval",
            "0.3",
            "--lengths",
            "200,600",
            "--depths",
            "0,25",
            "--trials",
            "1",
            "--window",
            "4",
            "--listen",
            "127.0.0.1:0",
            "--timeout",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(canary)
    line = canary.stdout.readline()
    assert line.startswith("READY "), canary.stderr.read()
    prom = PrometheusServer(tmp_path, [f"127.0.0.1:{int(line.split()[1])}"])
    try:
        recall, _ = prom.wait_for(
            "needlescope_recall", lambda r: len(r) == 2 and all(v == v for v in r.values())
        )
        assert recall == {(("length_bucket", "200"),): 1.0, (("length_bucket", "600"),): 0.0}
        assert prom.query("needlescope_target_up") == {(): 1.0}
        assert prom.query("needlescope_effective_length_tokens") == {(): 200.0}
        assert prom.query("up") == {(): 1.0}  # Prometheus's own view: the canary is scraped
        errors_before = prom.value('needlescope_probe_errors_total{kind="connection"}')

        procs[0].kill()  # the target goes away mid-run
        procs[0].wait(timeout=10)
        prom.wait_for("needlescope_target_up", lambda r: r[()] == 0.0)
        down_errors, _ = prom.wait_for(
            'needlescope_probe_errors_total{kind="connection"}', lambda r: max(r.values()) > errors_before
        )
        # The canary itself stays up and keeps the last recall it measured.
        assert prom.query("up") == {(): 1.0}
        assert prom.query("needlescope_recall")[(("length_bucket", "200"),)] == 1.0

        restarted = time.time()
        procs.append(scripted_target(target_port, 300))
        prom.wait_for("needlescope_target_up", lambda r: r[()] == 1.0)
        prom.wait_for("needlescope_last_success_timestamp_seconds", lambda r: r[()] > restarted)
        assert prom.query("needlescope_recall") == recall
    finally:
        prom.stop()
    canary.terminate()
    assert canary.wait(timeout=10) == 0
    log = canary.stderr.read()
    assert "is down" in log and log.count("is up") == 2, log
