"""``needlescope health`` and ``needlescope canary``: watch a deployment (``needlescope.watch``)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import sys

import typer

from needlescope.cli.probe_options import build, config_default, option_group
from needlescope.watch.config import CanaryConfig, HealthConfig

log = logging.getLogger("needlescope.watch")

_TARGET_FLAGS = ("kind", "value_digits", "tokenizer", "timeout_s", "extra_body", "api_key")


@option_group(HealthConfig, _TARGET_FLAGS)
def health_command(
    flags: dict,
    base_url: str = typer.Option(..., "--base-url", help="Server URL (root or ending in /v1)."),
    model: str = typer.Option(None, "--model", help="Model name; default: the first in /v1/models."),
    length: int = typer.Option(
        config_default(HealthConfig, "length"), "--length", help="Needle prompt length."
    ),
    depth: float = typer.Option(
        config_default(HealthConfig, "depth"), "--depth", help="Needle depth in percent."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of lines."),
) -> None:
    """Smoke-test a deployment: server, a HEALTHY chat, one needle. Exit 0 healthy, 1 unhealthy, 2 bad usage."""
    from needlescope.watch.health import run_health

    cfg = build(HealthConfig, flags, base_url=base_url, model=model, length=length, depth=depth)
    report = run_health(cfg)
    if as_json:
        print(json.dumps(report))
    else:
        for c in report["checks"]:
            ms = f"{c['latency_s'] * 1000:.0f} ms" if c["latency_s"] is not None else "-"
            print(f"{c['status']:<5} {c['name']:<7} {ms:>9}  {c['detail']}")
        if report["value_digits"] is not None:
            print(f"needle values: {report['value_digits']} digits, from {report['value_digits_source']}")
        verdict = "healthy" if report["healthy"] else "UNHEALTHY"
        print(f"{verdict}: {report['base_url']} model {report['model'] or '-'}")
    raise typer.Exit(0 if report["healthy"] else 1)


@option_group(CanaryConfig, ("lengths", "depths", "trials", "threshold", "skip_long_lengths", *_TARGET_FLAGS))
def canary_command(
    flags: dict,
    base_url: str = typer.Option(..., "--base-url", help="Server URL (root or ending in /v1)."),
    model: str = typer.Option(None, "--model", help="Model name; default: the first in /v1/models."),
    interval: float = typer.Option(
        config_default(CanaryConfig, "interval_s"), "--interval", help="Seconds per round."
    ),
    window: int = typer.Option(
        config_default(CanaryConfig, "window"), "--window", help="Probes per length in recall."
    ),
    max_in_flight: int = typer.Option(config_default(CanaryConfig, "max_in_flight"), "--max-in-flight"),
    listen: str = typer.Option(
        config_default(CanaryConfig, "listen"), "--listen", help="HOST:PORT of /metrics."
    ),
    queue_limit: int = typer.Option(
        None, "--queue-limit", help="Engine admission limit; default: /get_server_info's max_queued_requests."
    ),
    rounds: int = typer.Option(0, "--rounds", help="Stop after this many rounds (0: run until stopped)."),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning"),
) -> None:
    """Probe recall on a schedule and export it, the engine's load and the GPUs to Prometheus."""
    from needlescope.errors import BadInput

    try:
        from needlescope.watch.canary import Canary, serve_metrics
        from needlescope.watch.metrics import CanaryMetrics
    except ImportError as e:
        raise BadInput(f"needlescope canary needs {e.name}; pip install 'needlescope[watch]'") from None

    if rounds < 0:
        raise BadInput(f"--rounds must be 0 (run until stopped) or a positive count; got {rounds}")
    if log_level.lower() not in ("debug", "info", "warning"):
        raise BadInput(f"--log-level must be debug, info or warning; got {log_level!r}")
    cfg = build(
        CanaryConfig,
        flags,
        base_url=base_url,
        model=model,
        interval_s=interval,
        window=window,
        max_in_flight=max_in_flight,
        listen=listen,
        queue_limit=queue_limit,
    )
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request URL at INFO; the canary's own lines say what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    metrics = CanaryMetrics(cfg.lengths)
    host, _ = cfg.listen_address
    server = serve_metrics(metrics, *cfg.listen_address)
    if not _is_loopback(host):
        log.warning(
            "metrics are served on %s, beyond this machine; bind 127.0.0.1 unless that is meant", host
        )
    if metrics.gpu.reason:
        log.info("no GPU metrics: %s", metrics.gpu.reason)
    log.info(
        "watching %s every %gs at lengths %s; metrics at http://%s:%d/metrics",
        cfg.base_url,
        cfg.interval_s,
        ",".join(map(str, cfg.lengths)),
        host,
        server.server_port,
    )
    print(f"READY {server.server_port}", flush=True)
    try:
        asyncio.run(_watch(Canary(cfg, metrics), rounds or None))
    finally:
        server.shutdown()
        server.server_close()
    scored = sum(s.value for s in metrics.probes.collect()[0].samples if s.name.endswith("_total"))
    if rounds and not scored:
        # A bounded run is a check: one that scored no probe measured nothing, which is never healthy.
        log.error("no probe was scored in %d round(s): nothing was measured (see the lines above)", rounds)
        raise typer.Exit(1)


async def _watch(canary, rounds: int | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await canary.run(stop, rounds)
    finally:
        await canary.aclose()
        log.info("canary stopped")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
