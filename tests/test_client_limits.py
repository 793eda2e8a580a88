"""Every command that talks to a target ends within its ``--timeout`` plus a second, with bounded
memory, against a target that streams without end or trickles (issue 29, items 2 and 3).

Each command runs as a real CLI child against ``tests/hostile_peer.py`` on loopback; its wall time
and peak RSS (the child's own ``VmHWM``, polled: ``wait4``'s ``ru_maxrss`` starts from the
parent's RSS at exec, so in an xdist worker that has loaded torch it reports the worker) are measured. Before the fix ``health`` against ``endless`` grew to
3.3 GB in 8 s and against ``trickle`` hung past 200 s (here it would run into the subprocess
timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from needlescope.errors import AnswerTooLarge, TimedOut
from needlescope.targets import ChatTarget
from needlescope.targets.bounded import MAX_ANSWER_BYTES, BoundedTransport

sys.path.insert(0, str(Path(__file__).parent))
from hostile_peer import HostilePeer  # noqa: E402

# Four times the hostile peer's byte interval (0.25 s): a per-read timeout never fires, so only a
# bound on the whole request can end a trickle. Every hostile request costs the test this long.
TIMEOUT = 1.0
# The command's own work (imports, discovery, writing the report: probe's heatmap takes ~2 s) on
# a loaded 2-core box, with ``AT_ONCE - 1`` other children beside it (probe: 14.3 s at load
# average 21). Not a speed claim: the hang it guards against lasted minutes, and a client whose
# only bound is per read would read the trickle until the peer's own end (``HostilePeer``'s
# ``limit_s``, 30 s), past every bound here.
START_S = 20.0
# Children run at once: each spends most of its wall time waiting out a hostile answer (a second
# or two), so the file's ten commands took their sum one after another (~30 s of a worker's wall).
AT_ONCE = 2
# Requests each command sends that meet the hostile answer, one after another: probe's server
# info (/health, bounded as a whole by the timeout) and then its chat.
HOSTILE_REQUESTS = {"probe": 2}
RSS_LIMIT_KB = 400 * 1024


def _run(args: list[str], tmp_path: Path) -> tuple[float, int, int, str]:
    """(wall seconds, exit code, peak RSS in kB, output) of one CLI child."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "needlescope.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    peak_kb = 0
    while True:
        peak_kb = max(peak_kb, _high_water_kb(proc.pid))
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - start > 2 * TIMEOUT + START_S + 30:
            proc.kill()
            os.wait4(proc.pid, 0)
            reader.join(5)
            pytest.fail(f"{args[0]} still ran after {time.monotonic() - start:.0f}s: {chunks}")
        time.sleep(0.02)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(5)
    return wall, proc.returncode, peak_kb, b"".join(chunks).decode(errors="replace")


def _high_water_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM, kB) so far; 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


COMMANDS = {
    "health": lambda url, out: ["health", "--base-url", url, "--model", "m", "--value-digits", "3"],
    "probe": lambda url, out: [
        "probe", "--base-url", url, "--model", "m", "--lengths", "64", "--depths", "50",
        "--trials", "1", "--out", str(out),
    ],
    "canary": lambda url, out: [
        "canary", "--base-url", url, "--model", "m", "--rounds", "1", "--interval", "0.1",
        "--lengths", "64", "--depths", "50", "--trials", "1", "--value-digits", "3",
        "--listen", "127.0.0.1:0",
    ],
    "oracle": lambda url, out: ["oracle", "export", "--base-url", url, "--model", "m", "--out", str(out)],
}  # fmt: skip

CASES = [(c, "endless") for c in COMMANDS] + [(c, "trickle") for c in COMMANDS]
CASES += [("health", "trickle-headers"), ("oracle", "trickle-headers")]


def _run_against(command: str, mode: str, tmp_path: Path) -> tuple[float, int, int, str]:
    with HostilePeer(mode) as peer:
        args = [*COMMANDS[command](peer.url, tmp_path / "out"), "--timeout", str(TIMEOUT)]
        return _run(args, tmp_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(command, mode) -> a future of ``_run_against``'s result: every case's child started,
    ``AT_ONCE`` at a time, in their own directories; each test waits for its own."""
    dirs = {case: tmp_path_factory.mktemp(f"{case[0]}-{case[1]}") for case in CASES}
    with ThreadPoolExecutor(AT_ONCE) as pool:
        yield {case: pool.submit(_run_against, *case, d) for case, d in dirs.items()}, dirs


@pytest.mark.parametrize(("command", "mode"), CASES)
def test_command_ends_within_timeout(command, mode, runs):
    futures, dirs = runs
    wall, code, rss, out = futures[(command, mode)].result()
    tmp_path = dirs[(command, mode)]
    assert rss < RSS_LIMIT_KB, f"{command} vs {mode}: peak RSS {rss} kB\n{out[-800:]}"
    bound = HOSTILE_REQUESTS.get(command, 1) * TIMEOUT + START_S
    print(f"{command} vs {mode}: {wall:.1f}s (bound {bound:g}s), peak RSS {rss // 1024} MiB")
    assert wall < bound, f"{command} vs {mode}: {wall:.1f}s\n{out[-800:]}"
    # canary too: a bounded run (--rounds) that scored no probe measured nothing, exit 1.
    assert code != 0, out
    assert "Traceback" not in out, out
    kinds = ("timeout", "too_large", "OverLimit", "ReadTimeout", "no complete answer", "passed")
    assert any(k in out for k in kinds) or _recorded_kind(tmp_path / "out"), out


def _recorded_kind(out: Path) -> bool:
    results = out / "results.jsonl"
    if not results.exists():
        return False
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    return any(r.get("error_kind") in ("timeout", "too_large") for r in rows)


def test_chat_target_raises_timeout_and_too_large_kinds():
    """The chat client maps the two limits to their error kinds, with ``attempts`` and no retry."""
    import asyncio

    async def go(mode: str):
        with HostilePeer(mode) as peer:
            async with ChatTarget(peer.url, "m", timeout=1.0, retries=3) as target:
                start = time.monotonic()
                with pytest.raises((TimedOut, AnswerTooLarge)) as info:
                    await target.chat([{"role": "user", "content": "hi"}], max_tokens=4)
                return info.value, time.monotonic() - start

    err, took = asyncio.run(go("trickle"))
    assert isinstance(err, TimedOut) and err.kind == "timeout" and err.attempts == 1 and took < 2.5
    err, took = asyncio.run(go("endless"))
    assert isinstance(err, AnswerTooLarge) and err.kind == "too_large" and err.attempts == 1


def test_sync_cap_counts_decoded_bytes():
    """A mock answer just over the cap is refused; one at the cap is read whole."""

    def handler(request: httpx.Request) -> httpx.Response:
        n = int(request.url.params["n"])
        return httpx.Response(200, content=b"x" * n)

    with httpx.Client(transport=BoundedTransport(5.0, httpx.MockTransport(handler))) as client:
        assert len(client.get("http://t/", params={"n": MAX_ANSWER_BYTES}).content) == MAX_ANSWER_BYTES
        with pytest.raises(httpx.TransportError, match="passed"):
            client.get("http://t/", params={"n": MAX_ANSWER_BYTES + 1})


def test_error_rows_carry_attempts_when_a_200_cannot_be_parsed():
    import asyncio

    from needlescope.errors import ProtocolViolation

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"not json")

    async def go():
        async with ChatTarget("http://t/v1", "m", transport=httpx.MockTransport(handler)) as target:
            await target.chat([{"role": "user", "content": "hi"}], max_tokens=1)

    with pytest.raises(ProtocolViolation) as info:
        asyncio.run(go())
    assert info.value.attempts == 1


def test_a_tokenize_that_answers_503_is_not_reported_as_missing(monkeypatch):
    from needlescope.errors import BadInput
    from needlescope.targets import tokenize

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(404)

    real = tokenize.ServerTokenCounter.__post_init__

    def with_mock(self):
        self.transport = httpx.MockTransport(handler)
        real(self)

    monkeypatch.setattr(tokenize.ServerTokenCounter, "__post_init__", with_mock)
    with pytest.raises(BadInput, match="has a tokenize endpoint but it failed: .*HTTP 503"):
        tokenize.detect_server_tokenizer("http://t", "m")


def test_canary_logs_each_refusal_reason_once_per_minute(caplog):
    """A target that refuses every probe with HTTP 400: the canary says so at warning level, once
    per distinct reason per minute, with the count of the ones it did not repeat (before: nothing
    at the default level for 619 refusals in 23 minutes)."""
    import asyncio
    import logging

    from needlescope.watch.canary import Canary
    from needlescope.watch.config import CanaryConfig
    from needlescope.watch.gpu import GpuCollector, NoNvml
    from needlescope.watch.metrics import CanaryMetrics

    now = [1000.0]
    with HostilePeer("refuse") as peer:
        cfg = CanaryConfig(
            base_url=peer.url,
            model="m",
            lengths=(64,),
            depths=(50.0,),
            trials=1,
            value_digits=3,
            timeout_s=5.0,
        )
        metrics = CanaryMetrics(cfg.lengths, gpu=GpuCollector(nvml=NoNvml))

        async def go() -> None:
            canary = Canary(cfg, metrics, clock=lambda: now[0])
            try:
                for _ in range(3):
                    await canary.round()
                    now[0] += 10
                now[0] += 60
                await canary.round()
            finally:
                await canary.aclose()

        with caplog.at_level(logging.WARNING, logger="needlescope.watch"):
            asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "prompt rejected by policy" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "2 more like it" in lines[1], lines
