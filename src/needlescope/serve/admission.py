"""SGLang-style admission control: a bounded waiting queue in front of a bounded running batch.

- A request is *waiting* from admission until the engine takes it into a batch, then *running*
  until its last token. ``running <= max_running_requests`` and
  ``waiting <= max_queued_requests`` always hold.
- ``submit`` never blocks: when the waiting queue is full it raises ``Overloaded`` at once and
  the HTTP layer answers 503 (with ``Retry-After``). Nothing else is allocated for a refused
  request, so a burst beyond the bound costs only its HTTP parsing.
- ``take_batch`` (engine thread) takes the oldest waiting request plus more waiting requests
  with the same batch key (same prompt length: see ``engine``), in arrival order, within the
  prefill token budget and the room left beside the requests already running (continuous
  batching takes a batch while others decode).
- ``withdraw`` drops a waiting request whose client went away (a timed-out client that
  retries must not leave its first attempt in the queue).
- ``retry_after_s`` is the measured queue wait (an exponential average of how long recent
  requests waited before they ran), rounded up to whole seconds, 1..120: what a refused client
  is told to wait (``Retry-After``). A constant 1 s made the openai SDK give up after its few
  quick retries while each admitted request waited far longer.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from needlescope.serve.errors import Overloaded, ShuttingDown
from needlescope.serve.metrics import ServeMetrics

__all__ = ["Overloaded", "Admission"]

T = TypeVar("T")


class Admission(Generic[T]):
    def __init__(self, max_running: int, max_queued: int, metrics: ServeMetrics | None = None) -> None:
        if max_running < 1 or max_queued < 1:
            raise ValueError(f"max_running and max_queued must be >= 1; got {max_running}, {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.metrics = metrics
        self._cond = threading.Condition()
        self._waiting: deque[T] = deque()
        self._running = 0
        self._closed = False
        self._since: dict[int, float] = {}  # id(item) -> when it was admitted
        self._wait_s: float | None = None  # exponential average of the queue wait of requests taken to run

    @property
    def retry_after_s(self) -> int:
        return max(1, min(120, math.ceil(self._wait_s or 0.0)))

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return self._running

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(len(self._waiting), self._running)

    def submit(self, item: T) -> None:
        """Admit ``item`` or raise ``Overloaded`` (``ShuttingDown`` once closed); never blocks."""
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queued:
                if self.metrics is not None:
                    self.metrics.rejected.inc()
                raise Overloaded(
                    f"the server is at capacity: {self._running} requests running "
                    f"(max {self.max_running}) and {len(self._waiting)} waiting (max {self.max_queued}); "
                    f"retry in {self.retry_after_s}s",
                    self.retry_after_s,
                )
            self._waiting.append(item)
            self._since[id(item)] = time.monotonic()
            self._publish()
            self._cond.notify()

    def withdraw(self, item: T) -> bool:
        """Remove a still-waiting ``item`` (its client went away); False if it already runs."""
        with self._cond:
            try:
                self._waiting.remove(item)
            except ValueError:
                return False
            self._since.pop(id(item), None)
            self._publish()
            return True

    def take_batch(
        self,
        key: Callable[[T], Hashable],
        limit: Callable[[T], int] | None = None,
        timeout: float | None = None,
        ready: Callable[[T], bool] | None = None,
    ) -> list[T]:
        """Block until a request waits (or ``timeout``); return a batch and count it as running.

        ``key(item) is None`` runs the item alone; ``limit(first)`` caps the batch below the
        room left (``max_running`` minus those running: the engine's prefill token budget);
        ``ready(first)`` False leaves the oldest request waiting (one that must run alone waits
        for the running ones to finish) and returns no batch.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._waiting or self._closed, timeout=timeout):
                return []
            room = self.max_running - self._running
            if not self._waiting or room < 1 or (ready is not None and not ready(self._waiting[0])):
                return []
            first = self._waiting.popleft()
            batch = [first]
            k = key(first)
            cap = room if limit is None else max(1, min(room, limit(first)))
            if k is not None:
                for item in list(self._waiting):
                    if len(batch) >= cap:
                        break
                    if key(item) == k:
                        self._waiting.remove(item)
                        batch.append(item)
            self._running += len(batch)
            now = time.monotonic()
            for item in batch:
                waited = now - self._since.pop(id(item), now)
                self._wait_s = waited if self._wait_s is None else 0.8 * self._wait_s + 0.2 * waited
            self._publish()
            return batch

    def finish(self, n: int) -> None:
        """``n`` running requests are done."""
        with self._cond:
            self._running -= n
            self._publish()

    def close(self) -> list[T]:
        """Refuse new requests; return those still waiting (the caller fails them)."""
        with self._cond:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            self._since.clear()
            self._publish()
            self._cond.notify_all()
            return left
