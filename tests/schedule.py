"""The order `make test` hands test files to its two xdist workers: longest first.

`make test` runs ``pytest -n 2 --dist loadfile --no-loadscope-reorder``: each worker takes the
next whole file from the collection's order as it finishes one (a file's module fixtures, such
as its servers and reference runs, are then built once, in one worker). Files in order of their
measured seconds, longest first, is the longest-processing-time rule: the two workers end within
about one short file of each other, where the collection's alphabetical order could leave one
worker alone with a minute-long file at the end.

``file_durations.json`` holds each file's seconds (setup, call and teardown of its tests) from
one run; a file missing there counts as 0 and keeps its place among the short ones at the end.
It orders the run and nothing else: stale numbers cost wall time, never a result. Refresh it
from a run's report (``pytest ... --durations=0 -vv``, which lists every phase):
``python tests/schedule.py RUN.log``.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("file_durations.json")

# One line of pytest's --durations report: "12.34s call     tests/test_x.py::test_y[param]".
_REPORT_LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+?\.py)::")


def file_seconds(report: str) -> dict[str, float]:
    """Seconds per test file (by file name) summed over the phases a --durations report lists."""
    seconds: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = _REPORT_LINE.match(line)
        if m:
            seconds[Path(m.group(2)).name] += float(m.group(1))
    return dict(seconds)


def longest_files_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` (pytest items) reordered by their file's ``seconds``, longest first; a stable
    sort, so each file's tests keep their order and stay together."""
    return sorted(items, key=lambda item: -seconds.get(item.path.name, 0.0))


def load_seconds() -> dict[str, float]:
    return json.loads(DURATIONS.read_text())["seconds"] if DURATIONS.exists() else {}


def main(report_path: str) -> None:
    seconds = file_seconds(Path(report_path).read_text())
    ranked = dict(sorted(((f, round(s, 1)) for f, s in seconds.items() if s >= 1.0), key=lambda kv: -kv[1]))
    DURATIONS.write_text(json.dumps({"source": Path(report_path).name, "seconds": ranked}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
