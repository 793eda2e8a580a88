"""Prometheus metrics of one server, in its own registry (so several servers can live in a process).

Names (all prefixed ``needlescope_serve_``):

- ``requests_total{endpoint, status}``: finished HTTP requests by route and status code
- ``queue_depth``: requests admitted and waiting for a batch
- ``running_requests``: requests in the batch being decoded
- ``peak_queue_depth`` / ``peak_running_requests``: the largest values those gauges reached
- ``rejected_requests_total``: requests refused with 503 because the queue was full
- ``prompt_tokens_total`` / ``generation_tokens_total``: tokens prefilled and generated
- ``prompt_tokens_cached_total``: prompt tokens continued from the prefix cache (counted in
  ``prompt_tokens_total`` too)
- ``batch_size``: histogram of requests per prefill batch
- ``decode_batch_size``: histogram of requests running at each decode step (every cohort of
  the continuous batch counted)
- ``joined_mid_flight_total``: requests that joined while others were decoding
- ``speculative_draft_tokens_total`` / ``speculative_accepted_tokens_total``: draft tokens
  proposed and accepted; ``speculative_acceptance_rate``: accepted / proposed so far
- ``time_to_first_token_seconds`` / ``e2e_request_latency_seconds``: histograms, from admission
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["PREFIX", "ServeMetrics"]

PREFIX = "needlescope_serve_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._peaks = (0, 0)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting for a batch", registry=r)
        self.running = Gauge(PREFIX + "running_requests", "Requests being decoded", registry=r)
        self.peak_queue_depth = Gauge(PREFIX + "peak_queue_depth", "Largest queue depth seen", registry=r)
        self.peak_running = Gauge(PREFIX + "peak_running_requests", "Largest running count seen", registry=r)
        self.rejected = Counter(
            PREFIX + "rejected_requests", "Requests refused with 503 (queue full)", registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            PREFIX + "prompt_tokens_cached",
            "Prompt tokens whose state came from the prefix cache",
            registry=r,
        )
        self.batch_size = Histogram(
            PREFIX + "batch_size", "Requests per prefill batch", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.decode_batch = Histogram(
            PREFIX + "decode_batch_size",
            "Requests running at a decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.joined_mid_flight = Counter(
            PREFIX + "joined_mid_flight", "Requests that joined a running batch", registry=r
        )
        self.draft_tokens = Counter(
            PREFIX + "speculative_draft_tokens", "Speculative draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            PREFIX + "speculative_accepted_tokens", "Speculative draft tokens accepted", registry=r
        )
        acceptance = Gauge(
            PREFIX + "speculative_acceptance_rate", "Draft tokens accepted / proposed so far", registry=r
        )
        acceptance.set_function(self._acceptance_rate)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Admission to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Admission to last generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _acceptance_rate(self) -> float:
        proposed = self.draft_tokens._value.get()
        return self.accepted_tokens._value.get() / proposed if proposed else 0.0

    def set_load(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)
        self._peaks = (max(self._peaks[0], waiting), max(self._peaks[1], running))
        self.peak_queue_depth.set(self._peaks[0])
        self.peak_running.set(self._peaks[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
