"""The ledger's values checked as strictly as the probe's flags: ranges, unknown keys (with a
suggestion), and paths confined to the ledger's folder.

A ledger is input like any flag: a negative or huge trial count, a length no server can hold, a
misspelt key silently ignored, or a patch path pointing anywhere on the disk (a patch file is
executed) is refused with one line ``FILE:LINE: what; expected ...``. Paths (patch files,
``extra_patches``, ``env_file``, a ``source`` question's ``path``) must resolve inside the
ledger's folder, symlinks followed, unless the run is given ``--allow-outside``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

from needlescope.errors import BadInput

__all__ = ["LIMITS", "Tracked", "check_range", "confine", "read_utf8", "suggestion"]

LIMITS: dict[str, tuple[int, int]] = {
    "lengths": (1, 1_048_576),
    "trials": (1, 1000),
    "max_new_tokens": (1, 4096),
    "seed": (0, 2**63 - 1),
    "threads": (1, 1024),
    "prefill_chunk": (1, 1_048_576),
    "tier": (1, 99),
}
"""Inclusive ranges of the ledger's integers (lengths per entry): the probe's own flag limits
where it has them, else what any run of the organism or a real deployment could use."""


def suggestion(key: str, allowed: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_range(key: str, value: int) -> None:
    lo, hi = LIMITS[key]
    if not lo <= value <= hi:
        raise BadInput(f"{key} = {value}; expected {lo}..{hi}")


def confine(path: Path, base: Path, allow_outside: bool, what: str) -> Path:
    """``path`` (relative to ``base``) resolved; BadInput when it lies outside ``base`` and
    ``allow_outside`` is not set."""
    full = (base / path).resolve()
    root = base.resolve()
    if not allow_outside and full != root and root not in full.parents:
        raise BadInput(
            f"{what} {str(path)!r} is outside the ledger's folder {str(root)!r}; move it there, or run "
            "with --allow-outside if the ledger is yours and you mean it"
        )
    return full


class Tracked(dict):
    """A TOML table that remembers which keys the parser asked for (``in``, ``get``, ``[]``):
    the keys it never asked for are unknown."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.asked: set[str] = set()

    def __contains__(self, key: object) -> bool:
        self.asked.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def __getitem__(self, key: str):
        self.asked.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def unasked(self) -> list[str]:
        return [k for k in self if k not in self.asked]


def read_utf8(path: Path, what: str, expected: str) -> str:
    """The text of ``path``; BadInput naming the line of the first byte that is not UTF-8
    (``FILE:LINE: not UTF-8 text ...; expected``), or that it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInput(f"{what} {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise BadInput(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); {expected}"
        ) from None
