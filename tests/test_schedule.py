"""The longest-files-first order of `make test` (tests/schedule.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from schedule import file_seconds, load_seconds, longest_files_first


def test_a_durations_report_sums_each_files_phases():
    report = "\n".join(
        [
            "============================= slowest durations ==============================",
            "12.50s call     tests/test_b.py::test_one[x-1]",
            "2.00s setup    tests/test_b.py::test_one[x-1]",
            "0.25s teardown tests/test_a.py::Test::test_two",
            "(3 durations < 0.005s hidden.  Use -vv to show these durations.)",
            "1 passed in 15.00s",
        ]
    )
    assert file_seconds(report) == {"test_b.py": 14.5, "test_a.py": 0.25}


def test_files_go_longest_first_each_kept_together_in_its_order():
    items = [SimpleNamespace(path=Path(f"tests/{f}"), name=n) for f, n in
             [("test_a.py", "a1"), ("test_a.py", "a2"), ("test_b.py", "b1"), ("test_c.py", "c1"),
              ("test_c.py", "c2"), ("test_d.py", "d1")]]  # fmt: skip
    order = longest_files_first(items, {"test_c.py": 30.0, "test_b.py": 5.0})
    assert [i.name for i in order] == ["c1", "c2", "b1", "a1", "a2", "d1"]


def test_the_committed_durations_load():
    seconds = load_seconds()  # {} would leave the collection's alphabetical order
    assert seconds and all(isinstance(s, float) and s > 0 for s in seconds.values())
