"""How the library reports progress: one callback, never a print.

A long workflow takes ``progress: Progress`` and calls ``progress(task, done, total, detail)``
whenever a unit of ``task`` finishes (a case sent, a setting measured, a prompt exported):
``done`` of ``total`` units (``total`` None while unknown), ``detail`` a short note (``recall
0.92``, the suspect being measured). The command line renders it (``cli.progress``): a labelled
bar on a terminal, periodic plain lines otherwise. ``no_progress`` is the default everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress", "no_progress"]

Progress = Callable[[str, int, "int | None", str], None]


def no_progress(_task: str, _done: int, _total: int | None, _detail: str = "") -> None:
    """The progress callback of a caller that shows none."""
