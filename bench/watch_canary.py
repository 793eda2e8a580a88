"""The canary under a real Prometheus: outage and recovery times, memory over a long run.

usage: PYTHONPATH=src python3 bench/watch_canary.py [--seconds 120] [--interval 0.05] [--out DIR]

Starts the scripted server (300-word recall window), ``needlescope canary`` on it (lengths 200
and 600) and Prometheus scraping the canary every second, all on loopback. It then

1. waits for the recall series in Prometheus and saves a scrape excerpt and a query result;
2. kills the target and times how long Prometheus takes to show ``needlescope_target_up`` 0,
   restarts it and times the way back to 1 and to a new scored probe;
3. lets the canary run ``--seconds`` at ``--interval`` and samples its RSS every 5 s.

Prints one JSON object (the numbers docs/watch.md quotes) and writes the excerpts to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from needlescope.testing.prometheus import PrometheusServer, free_port, scripted_target


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=Path("watch-bench"))
    opts = p.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    target = scripted_target(port, 300)
    canary = subprocess.Popen(
        [
            *(sys.executable, "-m", "needlescope.cli.main", "canary"),
            *("--base-url", f"http://127.0.0.1:{port}/v1", "--interval", str(opts.interval)),
            *("--lengths", "200,600", "--depths", "0,25", "--trials", "1", "--window", "20"),
            *("--listen", "127.0.0.1:0", "--timeout", "5"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = canary.stdout.readline()
    metrics_url = f"http://127.0.0.1:{int(line.split()[1])}/metrics"
    work = Path(tempfile.mkdtemp(prefix="watch-bench-"))
    prom = PrometheusServer(work, [metrics_url.split("/")[2]])
    out: dict = {}
    try:
        _, out["first_recall_in_prometheus_s"] = prom.wait_for("needlescope_recall", lambda r: len(r) == 2)
        time.sleep(2)
        (opts.out / "scrape.txt").write_text(httpx.get(metrics_url).text)
        (opts.out / "query_recall.json").write_text(
            json.dumps(prom.query_raw("needlescope_recall"), indent=2)
        )

        target.kill()
        target.wait()
        _, out["down_visible_s"] = prom.wait_for("needlescope_target_up", lambda r: r[()] == 0.0)
        time.sleep(3)
        out["connection_errors_during_outage"] = prom.value(
            'needlescope_probe_errors_total{kind="connection"}'
        )
        restarted = time.time()
        target = scripted_target(port, 300)
        _, out["up_again_visible_s"] = prom.wait_for("needlescope_target_up", lambda r: r[()] == 1.0)
        _, out["scored_again_visible_s"] = prom.wait_for(
            "needlescope_last_success_timestamp_seconds", lambda r: r[()] > restarted
        )
        (opts.out / "query_errors.json").write_text(
            json.dumps(prom.query_raw("increase(needlescope_probe_errors_total[1m]) > 0"), indent=2)
        )

        samples = []
        start = time.monotonic()
        while time.monotonic() - start < opts.seconds:
            samples.append(
                {"t_s": round(time.monotonic() - start), "rss_kib": rss_kib(canary.pid)}
                | {"probes": sum(prom.query("needlescope_probes_total").values())}
            )
            time.sleep(5)
        out["rss_samples"] = samples
        out["probes_during_run"] = samples[-1]["probes"] - samples[0]["probes"]
    finally:
        prom.stop()
        canary.terminate()
        canary.wait(timeout=10)
        target.kill()
        target.wait()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
