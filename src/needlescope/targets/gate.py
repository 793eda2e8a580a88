"""How many requests may be in flight, adapted to a server that says it is busy."""

from __future__ import annotations

import asyncio
import collections
import time

__all__ = ["AdaptiveGate"]


class AdaptiveGate:
    """An async limit on requests in flight that backs off when the server rejects work (AIMD).

    A rejection (429/503) halves the limit, at most once per ``cooldown_s`` so that one burst of
    rejections counts once; every ``limit`` successes raise it by one, up to ``ceiling``. Use as
    ``async with gate:`` around one HTTP attempt (never around a backoff sleep).
    """

    def __init__(self, ceiling: int, cooldown_s: float = 0.25) -> None:
        self.ceiling = max(1, ceiling)
        self.limit = self.ceiling
        self.lowest = self.ceiling
        self.cooldown_s = cooldown_s
        self._in_flight = 0
        self._successes = 0
        self._last_cut = float("-inf")
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def __aenter__(self) -> None:
        # No lock: between the check and the increment nothing awaits, and the loop is one thread.
        while self._in_flight >= self.limit:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if not fut.done():
                    self._waiters.remove(fut)
        self._in_flight += 1

    async def __aexit__(self, *exc: object) -> None:
        self._in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self._in_flight
        while free > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                free -= 1

    def rejected(self) -> None:
        now = time.monotonic()
        if now - self._last_cut >= self.cooldown_s:
            self._last_cut = now
            self.limit = max(1, self.limit // 2)
            self.lowest = min(self.lowest, self.limit)
            self._successes = 0

    def success(self) -> None:
        if self.limit < self.ceiling:
            self._successes += 1
            if self._successes >= self.limit:
                self._successes = 0
                self.limit += 1
                self._wake()
