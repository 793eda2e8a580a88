"""``needlescope health`` and ``needlescope canary``: watch a deployment (``needlescope.watch``)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import signal
import sys

import typer
from rich.console import Console

from needlescope.run.config import parse_extra_body, parse_float_list, parse_int_list
from needlescope.watch.config import CanaryConfig, HealthConfig

err_console = Console(stderr=True)
log = logging.getLogger("needlescope.watch")

_API_KEY_ENV = ["NEEDLESCOPE_API_KEY", "OPENAI_API_KEY"]


def _default(cls: type, name: str):
    """A config field's default, so the CLI never repeats it as a literal."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = f.default
    return ",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else value


def health_command(
    base_url: str = typer.Option(..., "--base-url", help="Server URL (root or ending in /v1)."),
    model: str = typer.Option(None, "--model", help="Model name; default: the first in /v1/models."),
    length: int = typer.Option(_default(HealthConfig, "length"), "--length", help="Needle prompt length."),
    depth: float = typer.Option(_default(HealthConfig, "depth"), "--depth", help="Needle depth in percent."),
    kind: str = typer.Option(_default(HealthConfig, "kind"), "--kind"),
    value_digits: int = typer.Option(_default(HealthConfig, "value_digits"), "--value-digits"),
    tokenizer: str = typer.Option(_default(HealthConfig, "tokenizer"), "--tokenizer"),
    timeout: float = typer.Option(_default(HealthConfig, "timeout_s"), "--timeout", help="Per request, s."),
    extra_body: str = typer.Option(None, "--extra-body", help="JSON merged into each chat request."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of lines."),
    api_key: str = typer.Option(None, "--api-key", envvar=_API_KEY_ENV, show_default=False),
) -> None:
    """Smoke-test a deployment: server, a HEALTHY chat, one needle. Exit 0 healthy, 1 unhealthy, 2 bad usage."""
    from needlescope.watch.health import run_health

    cfg = HealthConfig(
        base_url=base_url,
        model=model,
        length=length,
        depth=depth,
        kind=kind,
        value_digits=value_digits,
        tokenizer=tokenizer,
        timeout_s=timeout,
        extra_body=parse_extra_body(extra_body),
        api_key=api_key,
    )
    report = run_health(cfg)
    if as_json:
        print(json.dumps(report))
    else:
        for c in report["checks"]:
            ms = f"{c['latency_s'] * 1000:.0f} ms" if c["latency_s"] is not None else "-"
            print(f"{c['status']:<5} {c['name']:<7} {ms:>9}  {c['detail']}")
        verdict = "healthy" if report["healthy"] else "UNHEALTHY"
        print(f"{verdict}: {report['base_url']} model {report['model'] or '-'}")
    raise typer.Exit(0 if report["healthy"] else 1)


def canary_command(
    base_url: str = typer.Option(..., "--base-url", help="Server URL (root or ending in /v1)."),
    model: str = typer.Option(None, "--model", help="Model name; default: the first in /v1/models."),
    interval: float = typer.Option(
        _default(CanaryConfig, "interval_s"), "--interval", help="Seconds per round."
    ),
    lengths: str = typer.Option(
        _default(CanaryConfig, "lengths"), "--lengths", help="Prompt lengths in tokens."
    ),
    depths: str = typer.Option(
        _default(CanaryConfig, "depths"), "--depths", help="Needle depths in percent."
    ),
    trials: int = typer.Option(
        _default(CanaryConfig, "trials"), "--trials", help="Cases per length and depth."
    ),
    window: int = typer.Option(
        _default(CanaryConfig, "window"), "--window", help="Probes per length in recall."
    ),
    threshold: float = typer.Option(_default(CanaryConfig, "threshold"), "--threshold"),
    max_in_flight: int = typer.Option(_default(CanaryConfig, "max_in_flight"), "--max-in-flight"),
    listen: str = typer.Option(_default(CanaryConfig, "listen"), "--listen", help="HOST:PORT of /metrics."),
    queue_limit: int = typer.Option(
        None, "--queue-limit", help="Engine admission limit; default: /get_server_info's max_queued_requests."
    ),
    kind: str = typer.Option(_default(CanaryConfig, "kind"), "--kind"),
    value_digits: int = typer.Option(_default(CanaryConfig, "value_digits"), "--value-digits"),
    tokenizer: str = typer.Option(_default(CanaryConfig, "tokenizer"), "--tokenizer"),
    timeout: float = typer.Option(_default(CanaryConfig, "timeout_s"), "--timeout", help="Per request, s."),
    extra_body: str = typer.Option(None, "--extra-body", help="JSON merged into each chat request."),
    rounds: int = typer.Option(0, "--rounds", help="Stop after this many rounds (0: run until stopped)."),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning"),
    api_key: str = typer.Option(None, "--api-key", envvar=_API_KEY_ENV, show_default=False),
) -> None:
    """Probe recall on a schedule and export it, the engine's load and the GPUs to Prometheus."""
    from needlescope.errors import BadInput

    try:
        from needlescope.watch.canary import Canary, serve_metrics
        from needlescope.watch.metrics import CanaryMetrics
    except ImportError as e:
        raise BadInput(f"needlescope canary needs {e.name}; pip install 'needlescope[watch]'") from None

    if log_level.lower() not in ("debug", "info", "warning"):
        raise BadInput(f"--log-level must be debug, info or warning; got {log_level!r}")
    cfg = CanaryConfig(
        base_url=base_url,
        model=model,
        interval_s=interval,
        lengths=parse_int_list(lengths, "--lengths"),
        depths=parse_float_list(depths, "--depths"),
        trials=trials,
        window=window,
        threshold=threshold,
        max_in_flight=max_in_flight,
        listen=listen,
        queue_limit=queue_limit,
        kind=kind,
        value_digits=value_digits,
        tokenizer=tokenizer,
        timeout_s=timeout,
        extra_body=parse_extra_body(extra_body),
        api_key=api_key,
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
