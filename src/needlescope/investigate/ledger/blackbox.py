"""The ``[blackbox]`` table of a black-box ledger: how many cases each discriminating experiment
sends (``measure.blackbox``), validated like every other ledger value.

::

    [blackbox]                 # candidate = "blackbox" only; every key optional
    dense_cases = 6            # cases at the dense length (outside_selection)
    failing_cases = 3          # failing cases sent again alone and teacher-forced
    scan_depths = 3            # failing depths of the residue scan (one case per length each)

The defaults are the sizes issue 53's planted set was decided at (docs/investigate.md); a
smaller plan is cheaper and still decides where its minimums hold. Each minimum is the
smallest count whose experiment can decide at all: six dense cases lost of six give
p = 1/64 and five give 1/32, four only 1/16 (alpha 0.05); ``decode_only`` needs two failing
cases teacher-forced; the scan needs one depth (whether that is enough depends on how many
residue classes the moduli make: docs/investigate.md).

``parse_topk_pair`` reads the black box's other ``[target]`` keys: ``topk_endpoint`` (the same
deployment served with a larger top-k) and ``topk_endpoint_topk``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from needlescope.investigate.ledger.checks import LIMITS, Tracked, Where, expect

__all__ = ["BlackboxPlan", "parse_blackbox", "parse_topk_pair"]


@dataclass(frozen=True)
class BlackboxPlan:
    """How many cases each black-box experiment sends after a loss (``measure.blackbox``)."""

    dense_cases: int = 6
    """Cases at the dense length (``ratio x top-k - 1`` tokens), spread over the symptom's depths."""
    failing_cases: int = 3
    """The first failing cases (shortest length first) sent again alone and teacher-forced."""
    scan_depths: int = 3
    """Up to this many of the shortest failing length's failing depths, one scan case at each."""

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_blackbox(where: Where, raw: object, blackbox: bool) -> BlackboxPlan:
    """The ``[blackbox]`` table (``raw``; None when the ledger has none) as a ``BlackboxPlan``;
    ``blackbox``: the ledger's candidate is ``"blackbox"`` (the table is refused otherwise)."""
    if raw is None:
        return BlackboxPlan()
    line = where.table_line("blackbox")
    if not isinstance(raw, dict):
        raise where.error(line, "blackbox must be a table ([blackbox])")
    if not blackbox:
        raise where.error(line, '[blackbox] is used only with candidate = "blackbox"')
    table = Tracked(raw)
    values = {}
    for f in fields(BlackboxPlan):  # the ranges are checks.LIMITS'
        lo, hi = LIMITS[f.name]
        value = expect(where, line, table, f.name, int, f"an integer in {lo}..{hi}", f.default)
        values[f.name] = where.in_range(f.name, value, line)
    where.no_unknown_keys(table, line, "[blackbox]")
    return BlackboxPlan(**values)


def parse_topk_pair(
    where: Where, t: dict, tl: int, endpoint: str | None, blackbox: bool
) -> tuple[str | None, int | None]:
    """(``topk_endpoint``, ``topk_endpoint_topk``) of a black-box ledger: an http(s) URL other
    than ``endpoint`` and, when given, a positive top-k; both None when left out."""
    url = t.get("topk_endpoint") or None
    topk = (
        expect(
            where, tl, t, "topk_endpoint_topk", int, "the second endpoint's index_topk (a positive integer)"
        )
        if "topk_endpoint_topk" in t
        else None
    )
    if url is None:
        if topk is not None:
            raise where.error(
                where.key_line("topk_endpoint_topk", tl), 'topk_endpoint_topk needs topk_endpoint = "URL"'
            )
        return None, None
    line = where.key_line("topk_endpoint", tl)
    if not blackbox:
        raise where.error(line, 'topk_endpoint is used only with candidate = "blackbox"')
    if not isinstance(url, str) or not re.match(r"https?://[^/\s]+", url):
        raise where.error(
            line, f"topk_endpoint = {url!r}; expected http://HOST:PORT (the larger-top-k server)"
        )
    if endpoint is not None and url.rstrip("/") == endpoint.rstrip("/"):
        raise where.error(
            line,
            "topk_endpoint is the endpoint itself; give the server that runs the same deployment with a "
            "larger --index-topk",
        )
    if topk is not None:
        where.in_range("topk_endpoint_topk", topk, tl)
    return url, topk
