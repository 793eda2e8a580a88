"""How the library reports progress: one callback type and one event type, never a print.

A long workflow takes ``progress: Progress`` and calls ``progress(task, done, total, detail)``
whenever a unit of ``task`` finishes (a case sent, a setting measured, a prompt exported):
``done`` of ``total`` units (``total`` None while unknown), ``detail`` a short note (``recall
0.92``, the suspect being measured). The command line renders it (``cli.progress``): a labelled
bar on a terminal, periodic plain lines otherwise. ``no_progress`` is the default everywhere.

A workflow whose steps are named happenings rather than counted units (a probe's "case done",
"retry" or "cell"; serve-probe-explain's "serve" or "rank dump" phase) takes ``on_event: Event`` and calls
``on_event(name, payload)`` with a JSON-able payload; ``no_event`` is its default. The command
line turns events into the same progress bar (``cli.probe.probe_events``, ``cli.serve_probe_explain``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress", "no_progress", "Event", "no_event"]

Progress = Callable[[str, int, "int | None", str], None]


def no_progress(_task: str, _done: int, _total: int | None, _detail: str = "") -> None:
    """The progress callback of a caller that shows none."""


Event = Callable[[str, dict], None]


def no_event(_name: str, _payload: dict) -> None:
    """The event callback of a caller that shows none."""
