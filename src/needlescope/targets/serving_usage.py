"""What a server says about how it served one answer: the serving extensions of ``usage``.

No standard names these fields. The spellings read (first found wins):

- batch size: ``usage.needlescope_batch.max_running``, ``usage.batch.size``, ``usage.batch_size``;
- requests that joined the batch mid-flight: ``usage.needlescope_batch.joined_beside``,
  ``usage.batch.joined_mid_flight``;
- speculative draft depth: ``usage.needlescope_speculative.draft_tokens``,
  ``usage.speculative.num_draft_tokens``, ``usage.num_draft_tokens``;
- draft acceptance rate (0..1): ``usage.needlescope_speculative.acceptance_rate``,
  ``usage.speculative.acceptance_rate``, ``usage.spec_acceptance_rate``, ``usage.acceptance_rate``.

``needlescope serve`` writes the ``needlescope_*`` spellings (``serve.protocol.Usage``); the
scripted server (``testing.scripted_server``) writes the second spelling of each, so both are
read by the same tests. Tolerant by contract: a missing field, a field of the wrong type, a
negative count or a rate outside 0..1 is ``None`` (unknown), never an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ServingUsage", "read_serving_usage"]


@dataclass(frozen=True)
class ServingUsage:
    """The serving extensions of one answer's usage; None: the server did not say."""

    batch_size: int | None = None
    joined_mid_flight: int | None = None
    draft_tokens: int | None = None
    acceptance_rate: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _path(usage: dict, *keys: str) -> Any:
    node: Any = usage
    for k in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(k)
    return node


def _count(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def _rate(x: Any) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0
    return float(x) if ok else None


def _first(usage: dict, read, *paths: tuple[str, ...]):
    for p in paths:
        value = read(_path(usage, *p))
        if value is not None:
            return value
    return None


def read_serving_usage(usage: Any) -> ServingUsage:
    """The serving extensions of a ``usage`` object (module docstring); all None for a non-dict."""
    if not isinstance(usage, dict):
        return ServingUsage()
    return ServingUsage(
        batch_size=_first(
            usage, _count, ("needlescope_batch", "max_running"), ("batch", "size"), ("batch_size",)
        ),
        joined_mid_flight=_first(
            usage, _count, ("needlescope_batch", "joined_beside"), ("batch", "joined_mid_flight")
        ),
        draft_tokens=_first(
            usage,
            _count,
            ("needlescope_speculative", "draft_tokens"),
            ("speculative", "num_draft_tokens"),
            ("num_draft_tokens",),
        ),
        acceptance_rate=_first(
            usage,
            _rate,
            ("needlescope_speculative", "acceptance_rate"),
            ("speculative", "acceptance_rate"),
            ("spec_acceptance_rate",),
            ("acceptance_rate",),
        ),
    )
