"""One warning line per kind per minute: how the server logs what a client can make happen often.

A flood (thousands of stalled connections, failed ``accept()`` calls, requests full of unknown
fields) must show in the log without filling it: ``LogThrottle.note(kind, message)`` logs the
first event of a kind, then at most one line per ``every_s`` seconds for it, each with the count
of events since the last line of that kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LogThrottle", "WARN_EVERY_S"]

WARN_EVERY_S = 60.0


@dataclass
class LogThrottle:
    log: logging.Logger
    every_s: float = WARN_EVERY_S
    clock: Callable[[], float] = time.monotonic
    _counts: dict = field(default_factory=dict)
    _last: dict = field(default_factory=dict)

    def note(self, kind: str, message: str | Callable[[], str]) -> bool:
        """Count one event of ``kind``; log ``message`` (built only when logged) at warning level
        if no line of this kind was logged in the last ``every_s`` seconds. True if it logged."""
        self._counts[kind] = self._counts.get(kind, 0) + 1
        now = self.clock()
        if now - self._last.get(kind, -self.every_s) < self.every_s:
            return False
        count = self._counts.pop(kind)
        self._last[kind] = now
        text = message() if callable(message) else message
        self.log.warning("%s (%d time%s since the last such line)", text, count, "" if count == 1 else "s")
        return True
