"""Ctrl-C: say what was saved and how to resume, then exit 130 (128 + SIGINT).

Every resumable command saves each finished case as it lands (a probe's SQLite store, an
investigation's ``measure/*.jsonl``), so an interrupt loses at most the cases in flight. The
command wraps its run in ``on_interrupt(saved, how)``: ``saved()`` counts what is on disk when
the interrupt arrives (read-only), ``how`` says how to continue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from needlescope.cli.output import err_console

__all__ = ["on_interrupt", "store_saved", "measured_saved"]

INTERRUPTED = 130


@contextmanager
def on_interrupt(saved: Callable[[], str], how: str) -> Iterator[None]:
    """On KeyboardInterrupt: one line (what ``saved()`` counts; ``how`` to resume), exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"interrupted: {saved()}; {how}", soft_wrap=True)
        raise typer.Exit(INTERRUPTED) from None


def store_saved(*stores: Path, sends: bool = False) -> Callable[[], str]:
    """``saved`` for runs kept in results stores: "20 of 30 cases saved" over all of them
    (``sends``: "7 of 16 sends saved" of an engine-state run, which sends a case in every arm)."""

    def count() -> str:
        from needlescope.errors import BadInput
        from needlescope.run.engine_state import planned_sends
        from needlescope.run.store import peek

        ok = total = 0
        for path in stores:
            if Path(path).is_file():
                try:
                    found = peek(path)
                except BadInput:
                    continue
                planned = (
                    planned_sends(found["fingerprint"] or {}, found["cases"]) if sends else found["cases"]
                )
                ok, total = ok + found["sends_ok" if sends else "ok"], total + planned
        if not total:
            return "no case was saved yet"
        return f"{ok} of {total} {'sends' if sends else 'cases'} saved"

    return count


def measured_saved(out: Path) -> Callable[[], str]:
    """``saved`` for an investigation: the measured cases in ``out/measure/*.jsonl``."""

    def count() -> str:
        files = sorted(Path(out, "measure").glob("*.jsonl"))
        n = sum(1 for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
        return f"{n} measured cases saved in {Path(out) / 'measure'}" if n else "no case was measured yet"

    return count
