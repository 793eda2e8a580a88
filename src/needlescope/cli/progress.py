"""The one progress display of every long command (probe, compare, bisect, investigate run, sweep,
diff, engine-state, oracle): it renders ``needlescope.progress`` callbacks.

On a terminal each task is a labelled bar: ``probe ━━━━━━━  37/140  1.9/s  ETA 0:54  recall 0.95``.
The rate and the ETA appear once one unit has finished in this process (before that: ``ETA
measuring``), so a run never shows a remaining time it has not measured. When stdout is not a
terminal (``| tee``, CI logs) it prints plain lines instead, at most one every ``interval_s``
(10 s): the first update at once, then the newest state of the task that moved last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from needlescope.cli.output import console as default_console

__all__ = ["PLAIN_INTERVAL_S", "ProgressView", "format_duration"]

PLAIN_INTERVAL_S = 10.0


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass
class _Task:
    """One task's counts and the moment of its first update here (the rate's origin)."""

    label: str
    done: int = 0
    total: int | None = None
    detail: str = ""
    started: float = 0.0
    done_at_start: int = 0
    bar_id: int | None = field(default=None, repr=False)

    def stats(self, now: float) -> str:
        """``37/140 (26%), 1.9/s, ETA 0:54``: the rate and ETA only once measured."""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        if self.total:
            count += f" ({100 * self.done / self.total:.0f}%)"
        return ", ".join([count, *self.timing(now)])

    def timing(self, now: float) -> list[str]:
        finished = self.done - self.done_at_start
        elapsed = now - self.started
        if finished <= 0 or elapsed <= 0:
            return ["ETA measuring"] if self.total is not None and self.done < self.total else []
        rate = finished / elapsed
        shown = f"{rate:.1f}/s" if rate >= 0.1 else f"{60 * rate:.1f}/min"
        if self.total is None:
            return [shown]
        if self.done >= self.total:
            return [shown, f"took {format_duration(elapsed)}"]
        return [shown, f"ETA {format_duration((self.total - self.done) / rate)}"]


class ProgressView:
    """Renders progress callbacks; use it as a context manager around the work, call it (or
    ``update``) as the library's ``progress(task, done, total, detail)``, ``note`` for a line."""

    def __init__(
        self,
        console: Console | None = None,
        *,
        interval_s: float = PLAIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or default_console
        self.live = self.console.is_terminal
        self.interval_s = interval_s
        self.clock = clock
        self._tasks: dict[str, _Task] = {}
        self._last_line: float | None = None
        self._bar: Progress | None = None

    def __enter__(self) -> ProgressView:
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[timing]}"),
                TextColumn("{task.fields[detail]}"),
                console=self.console,
            )
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __call__(self, task: str, done: int, total: int | None, detail: str = "") -> None:
        self.update(task, done, total, detail)

    def update(self, task: str, done: int, total: int | None, detail: str = "") -> None:
        now = self.clock()
        t = self._tasks.get(task)
        if t is None:
            t = self._tasks[task] = _Task(task, started=now, done_at_start=done)
        t.done, t.total, t.detail = done, total, detail
        if self._bar is not None:
            self._render_bar(t, now)
        elif self._last_line is None or now - self._last_line >= self.interval_s:
            self._last_line = now
            tail = f"  {detail}" if detail else ""
            self.console.print(f"{t.label}: {t.stats(now)}{tail}", markup=False, highlight=False)

    def _render_bar(self, t: _Task, now: float) -> None:
        assert self._bar is not None
        fields = {"timing": escape("  ".join(t.timing(now))), "detail": escape(t.detail)}
        if t.bar_id is None:
            t.bar_id = self._bar.add_task(escape(t.label), total=t.total, completed=t.done, **fields)
        # Drawn now, not at the next tick: the numbers on screen are the ones just reported.
        self._bar.update(t.bar_id, total=t.total, completed=t.done, refresh=True, **fields)

    def note(self, text: str) -> None:
        """A line of its own (above the bars on a terminal), printed as given, never as markup."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
