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
import re
from collections.abc import Iterable
from pathlib import Path

from needlescope.errors import BadInput

__all__ = ["LIMITS", "Tracked", "Where", "check_range", "confine", "expect", "read_utf8", "suggestion"]

LIMITS: dict[str, tuple[int, int]] = {
    "lengths": (1, 1_048_576),
    "trials": (1, 1000),
    "max_new_tokens": (1, 4096),
    "seed": (0, 2**63 - 1),
    "threads": (1, 1024),
    "prefill_chunk": (1, 1_048_576),
    "tier": (1, 99),
    "topk_endpoint_topk": (1, 1_048_576),
    # [blackbox] (investigate.ledger.blackbox says why each minimum)
    "dense_cases": (5, 1000),
    "failing_cases": (2, 100),
    "scan_depths": (1, 100),
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


class Where:
    """Finds the line of a table or key in the ledger text, for error messages."""

    def __init__(self, path: Path, text: str, allow_outside: bool = False):
        self.path, self.lines = path, text.splitlines()
        self.allow_outside = allow_outside

    def suspect_line(self, index: int) -> int:
        seen = -1
        for i, line in enumerate(self.lines, 1):
            if line.strip().startswith("[[suspects]]"):
                seen += 1
                if seen == index:
                    return i
        return 1

    def table_line(self, name: str) -> int:
        return next((i for i, ln in enumerate(self.lines, 1) if ln.strip() == f"[{name}]"), 1)

    def key_line(self, key: str, after: int = 1) -> int:
        pat = re.compile(rf"^\s*{re.escape(key)}\s*=")
        for i in range(max(after, 1), len(self.lines) + 1):
            if pat.match(self.lines[i - 1]):
                return i
        return after

    def error(self, line: int, what: str) -> BadInput:
        return BadInput(f"{self.path}:{line}: {what}")

    def in_range(self, key: str, value: int, after: int) -> int:
        try:
            check_range(key, value)
        except BadInput as exc:
            raise self.error(self.key_line(key, after), str(exc)) from None
        return value

    def path_inside(self, spec: str, base: Path, line: int, what: str) -> Path:
        try:
            return confine(Path(spec), base, self.allow_outside, what)
        except BadInput as exc:
            raise self.error(line, str(exc)) from None

    def no_unknown_keys(self, table: Tracked, line: int, where: str) -> None:
        """Every key of ``table`` the parser never asked for is unknown (so a field added to the
        parser is known here without a second list)."""
        for key in table.unasked():
            raise self.error(
                self.key_line(key, line), f"unknown key {key!r} in {where}{suggestion(key, table.asked)}"
            )


def expect(where: Where, line: int, table: dict, key: str, typ, what: str, default=None):
    """``table[key]`` as ``typ`` (an int taken as a float where a float is wanted), ``default``
    when missing and given; else an error at the key's line naming ``what`` was expected."""
    if key not in table:
        if default is not None:
            return default
        raise where.error(line, f"missing key {key!r}; expected {what}")
    value = table[key]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        raise where.error(where.key_line(key, line), f"{key} = {value!r}; expected {what}")
    return value
