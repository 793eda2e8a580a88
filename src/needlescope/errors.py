"""The exception tree every needlescope component raises.

NeedlescopeError
├── BadInput              the user's input is wrong; the CLI prints it and exits 2
└── ProbeError            the target failed a request (recorded as an error, never a miss)
    ├── TransportFailure  connection refused/reset, HTTP 429/5xx after retries
    │   └── TimedOut      no complete answer within the request's deadline (--timeout)
    ├── ProtocolViolation the server answered, but not in the OpenAI shape (garbage JSON, no choices)
    │   └── AnswerTooLarge the answer passed the clients' size limit (targets.bounded)
    └── ContextOverflow   the server refused the prompt as too long for its context
"""

from __future__ import annotations

__all__ = [
    "NeedlescopeError",
    "BadInput",
    "ProbeError",
    "TransportFailure",
    "ProtocolViolation",
    "ContextOverflow",
    "TimedOut",
    "AnswerTooLarge",
]


class NeedlescopeError(Exception):
    """Base of every error needlescope raises on purpose."""


class BadInput(NeedlescopeError):
    """Wrong user input. The message says what is wrong and what to do."""


class ProbeError(NeedlescopeError):
    """A request to the target failed; the run records it as an error."""

    kind = "probe_error"
    attempts: int | None = None  # requests sent before giving up, set by the client that raised it


class TransportFailure(ProbeError):
    kind = "transport"


class ProtocolViolation(ProbeError):
    kind = "protocol"


class ContextOverflow(ProbeError):
    kind = "context_overflow"


class TimedOut(TransportFailure):
    kind = "timeout"


class AnswerTooLarge(ProtocolViolation):
    kind = "too_large"
