"""Typed, validated settings of ``needlescope health`` and ``needlescope canary``; each default once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from needlescope.cases import KINDS
from needlescope.errors import BadInput
from needlescope.targets import normalize_base_url
from needlescope.targets.endpoints import check_api_key

__all__ = ["DEFAULT_LISTEN", "CanaryConfig", "HealthConfig", "TargetConfig", "parse_listen"]

DEFAULT_LISTEN = "127.0.0.1:9464"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); port 0 picks a free one."""
    raw = (text or "").strip()
    host, sep, port_text = raw.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise BadInput(
            f"--listen {raw!r} is not HOST:PORT with a port in 0..65535; pass e.g. {DEFAULT_LISTEN}"
        )
    return host, int(port_text)


def _positive(value: float, flag: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise BadInput(f"{flag} must be a positive number; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """Where the server is and how probes are built (shared by health and canary)."""

    base_url: str
    model: str | None = None
    """Model name as served; ``None`` takes the first one ``/v1/models`` lists."""
    kind: str = "single"
    value_digits: int | None = None
    """Digits per needle value; None: the target's advertised ``trained_value_digits``, else 7
    (``targets.limits.choose_value_digits``)."""
    tokenizer: str = "server"
    """``server`` (its ``/tokenize``) or a path to an HF ``tokenizer.json``."""
    max_tokens: int = 32
    timeout_s: float = 120.0
    extra_body: dict = field(default_factory=dict)
    seed: int = 0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        normalize_base_url(self.base_url)  # BadInput on a malformed URL
        if self.kind not in KINDS:
            raise BadInput(f"--kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.value_digits is not None and not 1 <= self.value_digits <= 12:
            raise BadInput(f"--value-digits must be in 1..12; got {self.value_digits}")
        if self.max_tokens < 1:
            raise BadInput(f"--max-tokens must be at least 1; got {self.max_tokens}")
        _positive(self.timeout_s, "--timeout")
        check_api_key(self.api_key)
        if self.tokenizer != "server" and not Path(self.tokenizer).exists():
            raise BadInput(f"--tokenizer {self.tokenizer} does not exist; pass 'server' or a tokenizer.json")


@dataclass(frozen=True, kw_only=True)
class HealthConfig(TargetConfig):
    """One smoke test: server, a chat that must say HEALTHY, one short needle."""

    length: int = 512
    """Prompt length of the needle check, in tokens."""
    depth: float = 50.0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.length < 1:
            raise BadInput(f"--length must be a positive token count; got {self.length}")
        if not 0 <= self.depth <= 100:
            raise BadInput(f"--depth must be a percentage in 0..100; got {self.depth}")


@dataclass(frozen=True, kw_only=True)
class CanaryConfig(TargetConfig):
    """Scheduled recall probes, exported for Prometheus."""

    interval_s: float = 60.0
    """Seconds between rounds; a round sends ``trials`` probes per length."""
    lengths: tuple[int, ...] = (2000, 8000, 32000)
    depths: tuple[float, ...] = (10.0, 50.0, 90.0)
    """Needle depths, one per round in turn (every probe is a fresh case with its own seed)."""
    trials: int = 1
    """Probes per length in each round, each a fresh case."""
    window: int = 20
    """Probes per length that the rolling recall covers."""
    threshold: float = 0.85
    """Recall an effective length must reach at it and at every shorter length."""
    max_in_flight: int = 1
    """Requests to the target at once; 1 never competes with production traffic."""
    listen: str = DEFAULT_LISTEN
    queue_limit: int | None = None
    """The engine's admission limit; ``None`` reads ``max_queued_requests`` from ``/get_server_info``."""
    at_limit_scrapes: int = 2
    """Consecutive scrapes at the limit before the canary warns that the queue sits there."""
    skip_long_lengths: bool = False
    """Drop (with a warning) lengths beyond the target's context instead of refusing to run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self.interval_s, "--interval")
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise BadInput(f"--lengths must be positive token counts; got {list(self.lengths)}")
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise BadInput(f"--depths must be percentages in 0..100; got {list(self.depths)}")
        if self.trials < 1:
            raise BadInput(f"--trials must be at least 1; got {self.trials}")
        if self.window < 1:
            raise BadInput(f"--window must be at least 1 probe; got {self.window}")
        if not 0 < self.threshold <= 1:
            raise BadInput(f"--threshold must lie in (0, 1]; got {self.threshold}")
        if self.max_in_flight < 1:
            raise BadInput(f"--max-in-flight must be at least 1; got {self.max_in_flight}")
        if self.queue_limit is not None and self.queue_limit < 1:
            raise BadInput(f"--queue-limit must be at least 1; got {self.queue_limit}")
        parse_listen(self.listen)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)
