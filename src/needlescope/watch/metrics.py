"""The canary's Prometheus metrics, in their own registry.

| name | type | labels | meaning |
|---|---|---|---|
| ``needlescope_recall`` | gauge | ``length_bucket`` | recall over the rolling window of that length's probes (NaN before any) |
| ``needlescope_probes_total`` | counter | ``length_bucket``, ``result`` (hit, miss) | scored probes |
| ``needlescope_effective_length_tokens`` | gauge | | longest length whose windowed recall, and every shorter one's, reaches the threshold; 0 when even the shortest fails |
| ``needlescope_target_up`` | gauge | | 1 when the last round reached the server, else 0 (NaN before the first round ends) |
| ``needlescope_probe_errors_total`` | counter | ``kind`` (timeout, connection, admission, 5xx, protocol, too_large, tokenize) | failed requests (never counted as misses) |
| ``needlescope_probe_latency_seconds`` | histogram | ``phase`` (ttft, e2e) | probe latency; ttft only from servers that stream |
| ``needlescope_last_success_timestamp_seconds`` | gauge | | Unix time of the last scored probe |
| ``needlescope_round_interval_seconds`` | gauge | | the canary's ``--interval``: how long a healthy canary may go between scored probes |
| ``needlescope_engine_queue_depth`` | gauge | | requests waiting in the engine (its own /metrics, normalized) |
| ``needlescope_engine_running_requests`` | gauge | | requests the engine is running |
| ``needlescope_engine_kv_cache_usage_ratio`` | gauge | | fullest KV cache, 0..1 |
| ``needlescope_engine_queue_limit`` | gauge | | the engine's admission limit, when known |
| ``needlescope_engine_queue_at_limit`` | gauge | | 1 when the queue depth has reached the limit |
| ``needlescope_gpu_*`` | gauges | ``gpu``, ``name`` | NVML readings (``watch.gpu``) |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from needlescope.watch.gpu import GPU_COUNT, GPU_METRICS, GpuCollector, NoNvml
from needlescope.watch.probe import ERROR_KINDS

__all__ = ["LATENCY_BUCKETS", "CanaryMetrics", "exported_names"]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
NAN = float("nan")


class CanaryMetrics:
    def __init__(self, lengths: tuple[int, ...], gpu: GpuCollector | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.recall = Gauge(
            "needlescope_recall", "Rolling recall by prompt length", ["length_bucket"], registry=r
        )
        self.probes = Counter(
            "needlescope_probes",
            "Scored probes by length and result",
            ["length_bucket", "result"],
            registry=r,
        )
        self.effective_length = Gauge(
            "needlescope_effective_length_tokens", "Effective context length (rolling)", registry=r
        )
        self.target_up = Gauge(
            "needlescope_target_up", "1 when the target answered the last round", registry=r
        )
        self.errors = Counter("needlescope_probe_errors", "Failed requests by kind", ["kind"], registry=r)
        self.latency = Histogram(
            "needlescope_probe_latency_seconds",
            "Probe latency by phase",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.last_success = Gauge(
            "needlescope_last_success_timestamp_seconds", "Unix time of the last scored probe", registry=r
        )
        # The no-scored-probe alert waits a few intervals: a canary that runs every 30 minutes
        # goes 30 minutes between scored probes by design (a fixed 15 minutes fired every round).
        self.interval = Gauge(
            "needlescope_round_interval_seconds", "Seconds between the canary's rounds", registry=r
        )
        self.engine_queue = Gauge("needlescope_engine_queue_depth", "Engine requests waiting", registry=r)
        self.engine_running = Gauge(
            "needlescope_engine_running_requests", "Engine requests running", registry=r
        )
        self.engine_kv = Gauge(
            "needlescope_engine_kv_cache_usage_ratio", "Engine KV-cache usage 0..1", registry=r
        )
        self.engine_limit = Gauge("needlescope_engine_queue_limit", "Engine admission limit", registry=r)
        self.engine_at_limit = Gauge(
            "needlescope_engine_queue_at_limit", "1 when the engine queue is at its limit", registry=r
        )
        # Series exist from the start, so a first error is an increase and "no data yet" is NaN.
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        for length in lengths:
            self.recall.labels(str(length)).set(NAN)
            for result in ("hit", "miss"):
                self.probes.labels(str(length), result)
        for phase in ("ttft", "e2e"):
            self.latency.labels(phase)
        # target_up too: 0 before the first round had ended read as "down" (a first round of long
        # probes on a busy server paged NeedlescopeTargetDown while the server answered).
        for gauge in (
            self.target_up,
            self.interval,
            self.effective_length,
            self.engine_queue,
            self.engine_running,
            self.engine_kv,
            self.engine_limit,
            self.engine_at_limit,
        ):
            gauge.set(NAN)
        self.gpu = gpu if gpu is not None else GpuCollector()
        r.register(self.gpu)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def exported_names() -> set[str]:
    """Every sample name a Prometheus server stores from the canary (dashboards may query only these)."""
    names = {GPU_COUNT, *GPU_METRICS}
    for family in CanaryMetrics((1,), gpu=GpuCollector(nvml=NoNvml)).registry.collect():
        names.update(sample.name for sample in family.samples)
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names
