"""Connection limits of the HTTP server: slow and half-open clients cannot take it down.

uvicorn arms its only connection timer (keep-alive) after a response, so a client that opens a
connection and sends a few bytes, or a header a byte at a time, holds a file descriptor for
ever; a few thousand of them exhaust the process's descriptors, and then ``/health`` and every
chat get nothing. ``guarded_protocol`` builds uvicorn's h11 protocol with three limits:

- **header deadline**: a connection must deliver a complete request head within
  ``header_timeout_s`` of its first byte (or of being opened); else it is closed.
- **body deadline**: the body must be complete within ``body_timeout_s`` of the head.
- **connection cap**: at most ``max_connections`` open at once, clipped below the process's
  descriptor limit with room for the descriptors already open and for one accept burst
  (asyncio accepts up to ``backlog`` connections before any of them reaches this code). A new connection at the cap closes the oldest connection that has
  no request in progress (half-open or idle keep-alive), so a flood of slow clients cannot keep a
  new ``/health`` out; with every connection busy, the new one is closed at once.

When a limit bites the server logs one warning line per limit per minute, with the count since
the last line. The timers are per connection and cannot be extended by trickling bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "ACCEPT_BACKLOG",
    "ConnectionGuard",
    "ConnectionLimits",
    "descriptor_headroom",
    "guarded_protocol",
    "quiet_accept_errors",
]

log = logging.getLogger("needlescope.serve")

# Descriptors kept free beyond those open at start: files and sockets opened while serving.
_SPARE_FDS = 32
_WARN_EVERY_S = 60.0
ACCEPT_BACKLOG = 256
"""The listen backlog, and so the largest accept burst (asyncio accepts up to this many at once)."""


def descriptor_headroom(backlog: int = ACCEPT_BACKLOG) -> int:
    """How many client connections the process's descriptor limit leaves room for, given the
    descriptors open now and one accept burst of ``backlog``."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    return max(16, soft - in_use - backlog - _SPARE_FDS)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    """Already clipped by ``descriptor_headroom`` (``for_server``)."""
    header_timeout_s: float
    body_timeout_s: float

    @classmethod
    def for_server(
        cls, max_connections: int, header_timeout_s: float, body_timeout_s: float
    ) -> ConnectionLimits:
        return cls(min(max_connections, descriptor_headroom()), header_timeout_s, body_timeout_s)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback for every failed ``accept()`` (out of descriptors: thousands a
    second); log one line per minute with the count instead, and keep the other handlers."""
    counts = {"n": 0, "last": -_WARN_EVERY_S}

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", ""))
        if "accept" not in message:
            loop.default_exception_handler(context)
            return
        counts["n"] += 1
        now = time.monotonic()
        if now - counts["last"] >= _WARN_EVERY_S:
            log.warning(
                "%s: %s (%d time(s) since the last such line)", message, context.get("exception"), counts["n"]
            )
            counts["n"], counts["last"] = 0, now

    loop.set_exception_handler(handler)


@dataclass
class ConnectionGuard:
    """The open connections of one server (oldest first) and the warning counters."""

    limits: ConnectionLimits
    open: dict = field(default_factory=dict)
    _counts: dict = field(default_factory=dict)
    _last_warned: dict = field(default_factory=dict)

    @property
    def cap(self) -> int:
        return self.limits.max_connections

    def admit(self, proto: GuardedH11Protocol) -> bool:
        """Register ``proto``; at the cap, close the oldest connection without a request in
        progress to make room, or refuse ``proto`` (False) when every one is busy."""
        if len(self.open) >= self.cap:
            victim = next((p for p in self.open if not p.busy), None)
            if victim is None:
                self.note("refused", f"connection cap of {self.cap} reached with every connection busy")
                return False
            self.note("evicted", f"connection cap of {self.cap} reached: closed the oldest idle connection")
            victim.drop()
        self.open[proto] = time.monotonic()
        return True

    def forget(self, proto: GuardedH11Protocol) -> None:
        self.open.pop(proto, None)

    def note(self, what: str, message: str) -> None:
        """Count one event of kind ``what``; log one line per kind per minute."""
        self._counts[what] = self._counts.get(what, 0) + 1
        now = time.monotonic()
        if now - self._last_warned.get(what, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            count = self._counts.pop(what)
            self._last_warned[what] = now
            log.warning("%s (%d time%s since the last such line)", message, count, "" if count == 1 else "s")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body deadlines and the connection cap."""

    guard: ConnectionGuard  # set on the subclass ``guarded_protocol`` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = "head"
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.close()
            return
        self._arm("head")

    @property
    def busy(self) -> bool:
        """A request is in progress (its head complete, its response not yet finished)."""
        return self.cycle is not None and not self.cycle.response_complete

    def drop(self) -> None:
        self.guard.forget(self)
        self._disarm()
        self.transport.close()

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        limits = self.guard.limits
        seconds = limits.header_timeout_s if phase == "head" else limits.body_timeout_s
        self._deadline = self.loop.call_later(seconds, self._expire, phase, seconds)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, phase: str, seconds: float) -> None:
        self._deadline = None
        what = "request head" if phase == "head" else "request body"
        self.guard.note(
            f"slow-{phase}", f"closed a connection that sent no complete {what} within {seconds:g}s"
        )
        self.drop()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            # Part of a head (a keep-alive connection's next request): its deadline starts with
            # its first byte and is not moved by later bytes.
            if self._deadline is None:
                self._arm("head")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif self._deadline is not None:
            self._disarm()
            self._phase = "done"

    def on_response_complete(self) -> None:
        self._disarm()
        self._phase = "idle"
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class (uvicorn's ``http=``) bound to one server's guard."""
    return type("NeedlescopeH11Protocol", (GuardedH11Protocol,), {"guard": ConnectionGuard(limits)})
