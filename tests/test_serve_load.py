"""Admission control under a real burst from another process on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from needlescope.serve.launch import ServerProcess
from needlescope.testing.checkpoints import save_random

SMALL = dict(hidden_size=64, q_lora_rank=32, o_lora_rank=32, moe_intermediate_size=64, index_topk=8)
QUEUED, RUNNING, BURST = 2, 1, 40

# Fires BURST concurrent chat requests and prints each one's status and latency as JSON.
BURST_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import httpx

    url, n = sys.argv[1], int(sys.argv[2])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the river ran past the mill"}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def one(client):
        t = time.monotonic()
        r = await client.post(url + "/v1/chat/completions", json=body)
        return {"status": r.status_code, "latency": time.monotonic() - t, "error": r.json().get("error")}

    async def main():
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            out = await asyncio.gather(*[one(client) for _ in range(n)])
        print(json.dumps(out))

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = save_random(tmp_path_factory.mktemp("ckpt"), seed=2, **SMALL)
    args = ["--model", str(ckpt), "--port", "0", "--served-model-name", "tiny"]
    args += ["--max-queued-requests", str(QUEUED), "--max-running-requests", str(RUNNING)]
    with ServerProcess(args) as srv:
        yield srv


def burst(url: str, tmp: Path) -> list[dict]:
    script = tmp / "burst.py"
    script.write_text(BURST_SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script), url, str(BURST)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def gauges(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def test_burst_beyond_the_queue_gets_503_at_once_and_memory_stays_flat(server, tmp_path):
    rss = [rss_kib(server.pid)]
    for _ in range(2):
        results = burst(server.url, tmp_path)
        rss.append(rss_kib(server.pid))
        statuses = [r["status"] for r in results]
        assert set(statuses) <= {200, 503}, statuses
        ok = [r for r in results if r["status"] == 200]
        busy = [r for r in results if r["status"] == 503]
        assert ok and busy, statuses
        assert all(r["error"]["code"] == "queue_full" for r in busy)
        # Refusals come back at once: typically faster than admitted requests, which have to decode.
        assert (
            sorted(r["latency"] for r in busy)[len(busy) // 2]
            < sorted(r["latency"] for r in ok)[len(ok) // 2]
        )
    g = gauges(server.url)
    assert g["needlescope_serve_peak_queue_depth"] <= QUEUED
    assert g["needlescope_serve_peak_running_requests"] <= RUNNING
    assert g["needlescope_serve_queue_depth"] == 0 and g["needlescope_serve_running_requests"] == 0
    assert g["needlescope_serve_rejected_requests_total"] > 0
    # Still healthy and serving.
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200
    # Memory flat: the second burst may not grow the process by more than a generous bound.

    growth = rss[2] - rss[1]
    assert growth < max(64 * 1024, rss[1] // 4), rss


def test_a_waiting_request_whose_client_left_is_withdrawn(server):
    chat = server.url + "/v1/chat/completions"
    before = gauges(server.url)
    long_body = {"model": "tiny", "messages": [{"role": "user", "content": "the mill"}], "max_tokens": 300}
    long_body |= {"temperature": 0, "ignore_eos": True}
    result: dict = {}

    def run_long():
        result["r"] = httpx.post(chat, json=long_body, timeout=120).json()

    t = threading.Thread(target=run_long)
    t.start()
    # Wait until the long request runs, then queue one behind it whose client gives up at once.
    while gauges(server.url)["needlescope_serve_running_requests"] < 1:
        pass
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(chat, json={**long_body, "max_tokens": 5}, timeout=0.3)
    t.join()
    after = gauges(server.url)
    # Only the long request generated tokens: the abandoned one never ran.
    generated = (
        after["needlescope_serve_generation_tokens_total"]
        - before["needlescope_serve_generation_tokens_total"]
    )
    assert generated == result["r"]["usage"]["completion_tokens"]
    assert after["needlescope_serve_queue_depth"] == 0
