"""Connection limits of the HTTP server: slow, stalled and half-closed clients cannot take it down.

uvicorn arms its only connection timer (keep-alive) after a response, so a client that opens a
connection and sends a few bytes, a header a byte at a time, or a complete head announcing a body
it never sends, holds a file descriptor for ever; a few thousand of them exhaust the process's
descriptors, and then ``/health`` and every chat get nothing. ``guarded_protocol`` builds uvicorn's
h11 protocol with a deadline on every phase in which the server waits for its peer, and a cap:

- **head**: a connection must deliver a complete request head within ``header_timeout_s`` of its
  first byte (or of being opened); else it is closed.
- **body**: the body must be complete within ``body_timeout_s`` of the head; else it is closed.
- **half-closed**: a client that half-closes (sends FIN) after its whole request still gets its
  answer (the write side stays open; the connection closes after the answer), but only within
  ``half_close_timeout_s`` of the FIN; after that the connection is closed and the request is
  cancelled like any other whose client left. A FIN before the request is complete closes the
  connection at once: nothing more can arrive.
- **connection cap**: at most ``max_connections`` open at once, clipped below the process's
  descriptor limit with room for the descriptors already open and for one accept burst
  (asyncio accepts up to ``backlog`` connections before any of them reaches this code). A new
  connection at the cap closes the oldest connection that owes the server bytes or sits idle
  (a partial head, a head whose body has not all arrived, an idle keep-alive), so a flood of slow
  or stalled clients cannot keep a new ``/health`` out; only connections whose request is
  complete and being answered are never evicted. With every connection answering, the new one
  is closed at once.

When a limit bites the server logs one warning line per limit per minute, with the count since
the last line. The timers are per connection and cannot be extended by trickling bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from needlescope.errors import BadInput
from needlescope.serve.throttle import LogThrottle

__all__ = [
    "ACCEPT_BACKLOG",
    "ConnectionGuard",
    "ConnectionLimits",
    "bind_listener",
    "descriptor_headroom",
    "guarded_protocol",
    "quiet_accept_errors",
]

log = logging.getLogger("needlescope.serve")

# Descriptors kept free beyond those open at start: files and sockets opened while serving.
_SPARE_FDS = 32
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
    half_close_timeout_s: float

    @classmethod
    def for_server(
        cls, max_connections: int, header_timeout_s: float, body_timeout_s: float, half_close_timeout_s: float
    ) -> ConnectionLimits:
        return cls(
            min(max_connections, descriptor_headroom()),
            header_timeout_s,
            body_timeout_s,
            half_close_timeout_s,
        )


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: ``serve`` binds before it loads the model, so a
    port in use is one clear line (BadInput) at once, not uvicorn's error after the load."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise BadInput(f"cannot listen on {host}:{port}: {e.strerror or e}; pass another --host") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = e.strerror or str(e)
        raise BadInput(
            f"cannot listen on {host}:{port}: {reason}; pass another --port (0 picks a free one)"
        ) from None
    return sock


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback for every failed ``accept()`` (out of descriptors: thousands a
    second); log one line per minute with the count instead, and keep the other handlers."""
    throttle = LogThrottle(log)

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", ""))
        if "accept" not in message:
            loop.default_exception_handler(context)
            return
        throttle.note("accept", lambda: f"{message}: {context.get('exception')}")

    loop.set_exception_handler(handler)


@dataclass
class ConnectionGuard:
    """The open connections of one server (oldest first) and the warning counters."""

    limits: ConnectionLimits
    open: dict = field(default_factory=dict)
    throttle: LogThrottle = field(default_factory=lambda: LogThrottle(log))

    @property
    def cap(self) -> int:
        return self.limits.max_connections

    def admit(self, proto: GuardedH11Protocol) -> bool:
        """Register ``proto``; at the cap, close the oldest connection that is not answering a
        complete request to make room, or refuse ``proto`` (False) when every one is answering."""
        if len(self.open) >= self.cap:
            victim = next((p for p in self.open if not p.busy), None)
            if victim is None:
                self.note("refused", f"connection cap of {self.cap} reached with every connection answering")
                return False
            self.note(
                "evicted",
                f"connection cap of {self.cap} reached: closed the oldest connection with no complete "
                "request (idle, or a head or body still owed)",
            )
            victim.drop()
        self.open[proto] = time.monotonic()
        return True

    def forget(self, proto: GuardedH11Protocol) -> None:
        self.open.pop(proto, None)

    def note(self, what: str, message: str) -> None:
        """Count one event of kind ``what``; log one line per kind per minute."""
        self.throttle.note(what, message)


_WHAT_WAS_OWED = {
    "head": "sent no complete request head within {:g}s",
    "body": "sent no complete request body within {:g}s of its head",
    "half-closed": "half-closed its side and could not be answered within {:g}s",
}


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the per-phase deadlines and the connection cap.

    ``_phase``: ``head`` (a request head is owed), ``body`` (its body is owed), ``answer`` (the
    request is complete and being answered), ``half-closed`` (being answered after the client's
    FIN), ``idle`` (keep-alive between requests: uvicorn's own timer closes it).
    """

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
        """A complete request is being answered: the only connections the cap never evicts."""
        answering = self.cycle is not None and not self.cycle.response_complete
        return answering and self._phase in ("answer", "half-closed")

    def drop(self) -> None:
        self.guard.forget(self)
        self._disarm()
        self.transport.close()

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        limits = self.guard.limits
        seconds = {
            "head": limits.header_timeout_s,
            "body": limits.body_timeout_s,
            "half-closed": limits.half_close_timeout_s,
        }[phase]
        self._deadline = self.loop.call_later(seconds, self._expire, phase, seconds)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, phase: str, seconds: float) -> None:
        self._deadline = None
        self.guard.note(f"slow-{phase}", "closed a connection that " + _WHAT_WAS_OWED[phase].format(seconds))
        self.drop()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            # Part of a head (a keep-alive connection's next request): its deadline starts with
            # its first byte and is not moved by later bytes.
            if self._phase != "head":
                self._arm("head")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif self._phase != "answer":  # the whole request is in (a keep-alive one may come whole)
            self._disarm()
            self._phase = "answer"

    def eof_received(self) -> bool | None:
        """The client half-closed. With its whole request in, keep the write side open to answer
        it (then close), within the half-close deadline; otherwise close now (True keeps it open)."""
        if not self.busy:
            return None
        # A FIN reads the same whether the client half-closed or left: the route withdraws a
        # request still waiting in the queue (admission control must not run abandoned work) and
        # answers one already running.
        self.cycle.scope[HALF_CLOSED] = True
        self.cycle.keep_alive = False  # uvicorn closes the connection after this answer
        self._arm("half-closed")
        return True

    def on_response_complete(self) -> None:
        self._disarm()
        self._phase = "idle"
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self._disarm()
        super().connection_lost(exc)


HALF_CLOSED = "needlescope.half_closed"
"""ASGI scope key set when the client sent its FIN after a whole request (``eof_received``)."""


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class (uvicorn's ``http=``) bound to one server's guard."""
    return type("NeedlescopeH11Protocol", (GuardedH11Protocol,), {"guard": ConnectionGuard(limits)})
