"""The recall canary: small probes on a schedule, a rolling window, Prometheus gauges.

A round, every ``interval_s``: GET ``/health`` (up or down), GET the engine's ``/metrics``
(normalized load, ``watch.engine``; the first round before that learns the engine's admission
limit from ``/get_server_info``), then ``trials`` probes per length, at most ``max_in_flight``
at once.
Nothing in a round raises for a failing target: a refused connection, a 503 or a garbage body is
an error of its kind and ``target_up`` says whether the server answered.

Every probe is a fresh case: its own seed (one more than the last probe's, from a random start),
so a new haystack and a new needle value; ``trials`` of them per length per round, all at one
depth, ``depths`` in turn from round to round. An engine's prefix
cache therefore never answers a probe from an earlier one. Cases are built token-exact through
the server's ``/tokenize`` when they are sent, so a canary started before its target simply
waits for it.

Memory is bounded by construction: the window holds ``window`` booleans per length, no case
outlives its round, and every metric has a fixed label set.

Logs (logger ``needlescope.watch``): one INFO line per round with each length's result and rolling
recall; errors at WARNING (each distinct reason at most once a minute); changes of state at INFO
or WARNING; prompts never, answers only at DEBUG; the API key never (it lives in request headers
only).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import httpx

from needlescope.analysis import cells_from_results, effective_length
from needlescope.cases import Case
from needlescope.errors import BadInput, ProbeError
from needlescope.targets import ChatTarget, normalize_base_url
from needlescope.targets.limits import choose_value_digits, fit_lengths
from needlescope.watch import probe
from needlescope.watch.config import CanaryConfig
from needlescope.watch.engine import UnexpectedFormat, normalize
from needlescope.watch.metrics import CanaryMetrics
from needlescope.watch.probe import STREAM_BODY, Outcome, RecordingTransport

__all__ = ["Canary", "RollingWindow", "serve_metrics"]

log = logging.getLogger("needlescope.watch")


class RollingWindow:
    """The last ``size`` scored probes of each length."""

    def __init__(self, lengths: tuple[int, ...], size: int) -> None:
        self._hits = {n: deque(maxlen=size) for n in lengths}

    def add(self, length: int, correct: bool) -> None:
        self._hits[length].append(correct)

    def recall(self, length: int) -> float:
        hits = self._hits[length]
        return sum(hits) / len(hits) if hits else math.nan

    def effective_length(self, threshold: float) -> float:
        """As the probe computes it, over the window; 0 if the shortest fails, NaN before any data."""
        rows = [
            {"length": n, "depth": 0.0, "status": "ok", "correct": c}
            for n, hits in self._hits.items()
            for c in hits
        ]
        if not rows:
            return math.nan
        eff = effective_length(cells_from_results(rows), threshold)
        return float(eff or 0)


def serve_metrics(metrics: CanaryMetrics, host: str, port: int):
    """Start the ``/metrics`` HTTP server (daemon thread); return it. Its port: ``server.server_port``."""
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as e:
        reason = e.strerror or str(e)
        raise BadInput(f"cannot listen on {host}:{port}: {reason}; pass another --listen HOST:PORT") from None
    return server


ERROR_LOG_EVERY_S = 60.0
"""The canary logs each distinct error reason at most once per this many seconds."""


class Canary:
    def __init__(
        self,
        cfg: CanaryConfig,
        metrics: CanaryMetrics,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        metrics.interval.set(cfg.interval_s)
        self.clock = clock
        self.root, self.v1 = normalize_base_url(cfg.base_url)
        self.window = RollingWindow(cfg.lengths, cfg.window)
        self.model: str | None = cfg.model
        self.queue_limit: int | None = cfg.queue_limit
        # A random first seed: a restarted canary does not repeat the probes of its last run.
        self._next_seed = random.randrange(2**31)
        self._counter = None
        """What counts tokens for the cases (``probe.token_counter``), found once and kept."""
        # Cases are built on one thread of their own: spread over asyncio's default pool, each
        # thread's allocator arena kept some of the haystack strings and RSS crept up per probe.
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="canary-cases")
        self._rounds = 0
        self._fitted: tuple[tuple[int, ...], int] | None = None
        """(lengths that fit the target, digits per value), resolved the first time it answers."""
        self._up: bool | None = None
        self._warned: set[str] = set()
        self._error_log: dict[str, list[float]] = {}  # reason -> [last logged at, suppressed since]
        self._at_limit_run = 0
        self._recorders = [RecordingTransport(transport) for _ in range(cfg.max_in_flight)]
        self._targets: list[ChatTarget] = []
        self._client = probe.watch_client(cfg, transport)

    async def aclose(self) -> None:
        if self._counter is not None:
            probe.close_counter(self._counter)
        self._builder.shutdown(wait=False, cancel_futures=True)
        await self._client.aclose()
        for target in self._targets:
            await target.aclose()

    async def run(self, stop: asyncio.Event, rounds: int | None = None) -> None:
        """Run rounds every ``interval_s`` until ``stop`` is set (or ``rounds`` have run)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        for n in itertools.count(1):
            # A stop abandons the round in flight: a probe is cheap to lose, a slow shutdown is not.
            current = asyncio.ensure_future(self.round())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({current, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not current.done():
                current.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await current
                return
            current.result()  # a bug in a round surfaces here, not in a lost task
            if stop.is_set() or (rounds is not None and n >= rounds):
                return
            # A round longer than the interval skips the slots it overran instead of bunching up.
            due = max(due + self.cfg.interval_s, loop.time())
            try:
                await asyncio.wait_for(stop.wait(), due - loop.time())
                return
            except asyncio.TimeoutError:  # noqa: UP041  (distinct from TimeoutError on 3.10)
                pass

    async def round(self) -> None:
        server = await probe.check_server(self._client, self.root, self.v1)
        if server.error is not None:
            self._count_error(server)
            self._set_up(False, server.detail)
            return
        try:
            if self._fitted is None:  # until the target's limits are known: checked every round
                self.model = await probe.resolve_model(self._client, self.v1, self.model)
            # Not caught below: lengths the target cannot hold end the canary (BadInput, exit 2).
            lengths, digits = await self._fit()
        except BadInput as e:
            if self.model is None:  # no model listed yet (still loading?): try again next round
                self._warn_once("cases", f"cannot build probe cases: {e}")
                self._set_up(True, "the server answers, but no probe could be built")
                return
            raise
        except (httpx.TransportError, OSError) as e:
            self._count_error(Outcome(None, "connection", f"{type(e).__name__}: {e}", 0.0))
            self._set_up(False, "lost the server while reading its limits")
            return
        # The engine's load before this round's own requests (building cases asks /tokenize).
        await self._scrape_engine()
        try:
            self._ensure_targets()
            cases = await self._fresh_cases(lengths, digits)
        except (BadInput, ProbeError) as e:
            if isinstance(e, BadInput) and (self._counter is not None or self.cfg.tokenizer != "server"):
                # Not the server (its /tokenize failing is a ProbeError, or a BadInput before a
                # counter was found): --tokenizer PATH, or a length too short for the needle,
                # fails every round alike. Bad usage ends the canary (exit 2).
                raise
            if isinstance(e, ProbeError):
                # The server's token counting failed (its /tokenize timed out, answered 5xx...): a
                # failed request of the canary's, counted and logged as a probe's is. It was one
                # warning for the whole run and no count: a canary that measured nothing for
                # hours showed no error on the dashboard and, after its first episode, none in the log.
                self._count_error(Outcome(None, "tokenize", f"cannot build probe cases: {e}", 0.0))
            else:
                self._warn_once("cases", f"cannot build probe cases: {e}")
            cases = None
        except (httpx.TransportError, OSError) as e:
            self._count_error(Outcome(None, "connection", f"{type(e).__name__}: {e}", 0.0))
            self._set_up(False, "lost the server while building cases")
            return
        if cases is None:
            self._set_up(True, "the server answers, but no probe could be built")
            return
        gate = asyncio.Semaphore(self.cfg.max_in_flight)
        free = list(range(self.cfg.max_in_flight))

        async def one(case: Case) -> Outcome:
            async with gate:
                slot = free.pop()
                try:
                    outcome = await probe.probe_case(
                        self._targets[slot],
                        self._recorders[slot],
                        case,
                        max_tokens=self.cfg.max_tokens,
                        extra_body={**STREAM_BODY, **self.cfg.extra_body},
                    )
                finally:
                    free.append(slot)
                self._record(case.length, outcome)
                return outcome

        outcomes = await asyncio.gather(*(one(case) for case in cases))
        reached = any(o.error not in ("connection", "timeout") for o in outcomes)
        self._set_up(reached, "; ".join(o.detail for o in outcomes if o.error))
        self.metrics.effective_length.set(self.window.effective_length(self.cfg.threshold))
        self._log_round(cases, outcomes)

    def _log_round(self, cases: list[Case], outcomes: list[Outcome]) -> None:
        """One line per round: each length's results (hit, miss or the error's kind, one per
        probe) and its rolling recall, then the effective length over the window."""
        self._rounds += 1
        results: dict[int, list[str]] = {}
        for case, o in zip(cases, outcomes, strict=True):
            results.setdefault(case.length, []).append(o.error or ("hit" if o.correct else "miss"))
        parts = []
        for length, got in results.items():
            recall = self.window.recall(length)
            shown = "-" if math.isnan(recall) else f"{recall:.2f}"
            parts.append(f"{length} tokens {'/'.join(got)} (recall {shown})")
        eff = self.window.effective_length(self.cfg.threshold)
        log.info(
            "round %d: %s; effective length %s",
            self._rounds,
            ", ".join(parts),
            "-" if math.isnan(eff) else f"{eff:g}",
        )

    def _record(self, length: int, outcome: Outcome) -> None:
        m = self.metrics
        m.latency.labels("e2e").observe(outcome.e2e_s)
        if outcome.ttft_s is not None:
            m.latency.labels("ttft").observe(outcome.ttft_s)
        if outcome.error is not None:
            self._count_error(outcome)
            return
        self.window.add(length, bool(outcome.correct))
        m.recall.labels(str(length)).set(self.window.recall(length))
        m.probes.labels(str(length), "hit" if outcome.correct else "miss").inc()
        m.last_success.set(self.clock())
        log.debug("length %d: %s, answer %r", length, outcome.detail, outcome.answer[:200])

    def _count_error(self, outcome: Outcome) -> None:
        """Count the error; log it at warning level once per distinct reason per minute (a target
        refusing every probe must show in the log, not only in a counter), with how many of the
        same were not logged since."""
        self.metrics.errors.labels(outcome.error).inc()
        reason = f"{outcome.error}: {outcome.detail[:300]}"
        seen = self._error_log.get(reason)
        now = self.clock()
        if seen is not None and now - seen[0] < ERROR_LOG_EVERY_S:
            seen[1] += 1
            return
        more = f" ({int(seen[1])} more like it since the last such line)" if seen and seen[1] else ""
        # Forget reasons not logged within the last minute (they would be logged anew anyway; a
        # count of repeats not yet reported goes, needlescope_probe_errors_total keeps every one):
        # a server whose messages vary ("Used 29182 of 30000 tokens", a request id) added one
        # entry per error for as long as the canary ran, and memory is bounded by construction.
        for old in [r for r, (at, _) in self._error_log.items() if now - at >= ERROR_LOG_EVERY_S]:
            del self._error_log[old]
        self._error_log[reason] = [now, 0]
        log.warning("probe error (%s): %s%s", outcome.error, outcome.detail[:300], more)

    def _set_up(self, up: bool, detail: str) -> None:
        self.metrics.target_up.set(1 if up else 0)
        if up != self._up:
            if up:
                log.info("target %s is up (model %s)", self.root, self.model or "not yet known")
            else:
                log.warning("target %s is down: %s", self.root, detail)
        self._up = up

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    async def _fit(self) -> tuple[tuple[int, ...], int]:
        """The lengths to probe and the value length, from what the target advertises (once)."""
        if self._fitted is not None:
            return self._fitted
        cfg = self.cfg
        limits, provenance = await asyncio.to_thread(probe.target_limits, cfg, self.root, self.v1, self.model)
        kept, dropped = fit_lengths(
            cfg.lengths, limits, answer_tokens=cfg.max_tokens, skip=cfg.skip_long_lengths
        )
        if dropped:
            log.warning(
                "skipping lengths %s: beyond the target's context of %d tokens (%s); probing %s",
                ",".join(map(str, dropped)),
                limits.context,
                limits.context_from,
                ",".join(map(str, kept)),
            )
        digits, source = choose_value_digits(cfg.value_digits, limits)
        log.info("needle values: %d digits, from %s", digits, source)
        if self.queue_limit is None:
            self.queue_limit = _advertised_queue_limit(provenance)
        self._fitted = kept, digits
        return self._fitted

    def _ensure_targets(self) -> None:
        if not self._targets:
            self._targets = [
                probe.probe_target(self.v1, self.model, self.cfg, rec) for rec in self._recorders
            ]

    async def _fresh_cases(self, lengths: tuple[int, ...], digits: int) -> list[Case]:
        """``trials`` new cases per length: each with its own seed (a new haystack and needle),
        all at this round's depth (``depths`` in turn, round by round)."""
        cfg = self.cfg
        depth = cfg.depths[self._rounds % len(cfg.depths)]
        loop = asyncio.get_running_loop()
        if self._counter is None:
            self._counter = await loop.run_in_executor(
                self._builder, probe.token_counter, cfg, self.root, self.model
            )
        cases = []
        for length in (n for n in lengths for _ in range(cfg.trials)):
            seed, self._next_seed = self._next_seed, self._next_seed + 1
            build = partial(
                probe.build_probe_cases,
                replace(cfg, seed=seed),
                self.root,
                self.model,
                lengths=(length,),
                depths=(depth,),
                trials=1,
                value_digits=digits,
                counter=self._counter,
            )
            (case,) = await loop.run_in_executor(self._builder, build)
            cases.append(case)
        # The first round says what is probed; later rounds only at debug level.
        log.log(
            logging.INFO if self._rounds == 0 else logging.DEBUG,
            "built %d probe cases for model %s at lengths %s, depth %g (a fresh case, a new seed, per probe)",
            len(cases),
            self.model,
            list(lengths),
            depth,
        )
        return cases

    async def _scrape_engine(self) -> None:
        m = self.metrics
        url = self.root + "/metrics"
        try:
            resp = await self._client.get(url)
        except httpx.TransportError as e:
            self._warn_once("metrics-transport", f"engine metrics at {url} failed: {type(e).__name__}")
            return
        if resp.status_code == 404:
            self._warn_once("metrics-404", f"the engine has no {url}; engine gauges stay empty")
            return
        try:
            if resp.status_code != 200:
                raise UnexpectedFormat(f"HTTP {resp.status_code}")
            load = normalize(resp.text)
        except UnexpectedFormat as e:
            self._warn_once(f"metrics-format-{str(e)[:40]}", f"ignoring engine metrics at {url}: {e}")
            for gauge in (m.engine_queue, m.engine_running, m.engine_kv, m.engine_at_limit):
                gauge.set(math.nan)
            return
        nan = math.nan
        m.engine_queue.set(load.queue_depth if load.queue_depth is not None else nan)
        m.engine_running.set(load.running if load.running is not None else nan)
        m.engine_kv.set(load.kv_cache_usage if load.kv_cache_usage is not None else nan)
        if self.queue_limit is None or load.queue_depth is None:
            m.engine_at_limit.set(nan)
            return
        m.engine_limit.set(self.queue_limit)
        at_limit = load.queue_depth >= self.queue_limit
        m.engine_at_limit.set(1 if at_limit else 0)
        self._at_limit_run = self._at_limit_run + 1 if at_limit else 0
        if self._at_limit_run == self.cfg.at_limit_scrapes:
            log.warning(
                "the %s engine queue has sat at its admission limit (%d) for %d scrapes; "
                "requests beyond it are refused",
                load.engine,
                self.queue_limit,
                self._at_limit_run,
            )


def _advertised_queue_limit(provenance: dict) -> int | None:
    """``max_queued_requests`` from ``/get_server_info`` (top level or its ``args``), if given."""
    info = provenance.get("/get_server_info")
    if not isinstance(info, dict):
        return None
    args = info.get("args") if isinstance(info.get("args"), dict) else {}
    limit = info.get("max_queued_requests", args.get("max_queued_requests"))
    return limit if isinstance(limit, int) and limit > 0 else None
