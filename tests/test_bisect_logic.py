"""The bisection's decisions in-process: a bisector whose 'server' is a table of outcomes per
length and trial (deterministic), so every step, escalation and stop is checked exactly. The
real-server tests are tests/test_bisect.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from needlescope.errors import BadInput
from needlescope.run.bisect import BisectConfig, _Bisector, _crossing, _no_bracket, _search


class TableBisector(_Bisector):
    """``correct(length, case_index) -> bool``: case i at a length is right or not; evaluate
    adds cases up to trials x depths per length, exactly as the store would."""

    def __init__(self, correct, *, trials=1, depths=(0, 100), threshold=0.85, **bis):
        self.cfg = SimpleNamespace(threshold=threshold, depths=depths, trials=trials)
        self.bis = BisectConfig(boundaries=(), **bis)
        self.trials = trials
        self.max_trials = max(trials, self.bis.max_trials or 4 * trials)
        self.trials_at: dict[int, int] = {}
        self.phase: dict[int, str] = {}
        self.steps: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self.on_event = lambda name, payload: self.events.append((name, payload))
        self.correct = correct
        self.sent: dict[int, int] = {}

    async def evaluate(self, lengths, phase, trials=None):
        trials = trials or self.trials
        for n in lengths:
            if self.trials_at.get(n, 0) < trials:
                self.phase.setdefault(n, phase)
                self.trials_at[n] = trials
                self.sent[n] = trials * len(self.cfg.depths)
        self.events.append(("evaluate", {"phase": phase, "lengths": list(lengths), "trials": trials}))
        return self.tally()

    def tally(self):
        return {n: (sum(self.correct(n, i) for i in range(m)), m) for n, m in sorted(self.sent.items())}


def _run(b: TableBisector, lo=200, hi=1000, boundaries=()):
    return asyncio.run(_search(b, lo, hi, list(boundaries)))


def test_a_clean_step_narrows_to_the_resolution_with_evidence():
    b = TableBisector(lambda n, i: n < 733, resolution=8)
    res = _run(b)
    assert res["confirmed"] and res["bracket"][0] < 733 <= res["bracket"][1]
    assert res["bracket"][1] - res["bracket"][0] <= 8
    assert all(s["narrowed"] and s["p_value"] < 0.05 for s in res["steps"])
    # 2 cases a length (2/2 vs 0/2, p = 0.33) first escalate to 4 (4/4 vs 0/4, p = 0.029).
    first = res["steps"][0]
    assert first["tested"] is None and first["last_pass"]["n"] == first["first_fail"]["n"] == 4
    assert first["last_pass"]["length"] == 600 and first["first_fail"]["length"] == 800
    assert res["crossing"]["last_pass"]["length"] == res["bracket"][0]
    assert res["crossing"]["confidence"] == pytest.approx(
        1 - 0.85**4 - 0.15**4 - 4 * 0.85 * 0.15**3, abs=1e-9
    ) or (res["crossing"]["confidence"] > 0)
    assert "where this sample crossed 0.85" in res["message"] and "(resolution 8)" in res["message"]
    evidence = [p for name, p in b.events if name == "bisect_evidence"]
    assert evidence == res["steps"]


def test_an_unconfirmed_coarse_bracket_is_reported_not_narrowed():
    # 2 of every 3 cases right past 600 tokens (0.67 < 0.85): with at most 2 x 4 = 8 cases the
    # ends (8/8 against 6/8, p = 0.47) never differ.
    b = TableBisector(lambda n, i: n < 600 or i % 3 != 0, resolution=8)
    res = _run(b)
    assert res["bracket"] == (400, 600) and not res["confirmed"]
    (step,) = res["steps"]
    assert not step["narrowed"] and step["p_value"] > 0.05
    assert step["last_pass"]["n"] == step["first_fail"]["n"] == 8  # the cap: 4 x 1 trial x 2 depths
    assert "do not differ significantly" in res["message"] and "raise --trials" in res["message"]
    assert not [n for n, ph in b.phase.items() if ph == "bisect"]


def test_a_step_that_cannot_be_confirmed_stops_the_bisection():
    # Recall 1 below 450, a plateau at 0.75 from 450 to 600, 0 from 600: the coarse bracket
    # (400, 600) is clear, but the midpoint 500 fails at 0.75 without differing from 400 (8/8
    # against 6/8 at the cap) and is not narrowed on.
    b = TableBisector(lambda n, i: n < 450 or (n < 600 and i % 4 != 0), resolution=8)
    res = _run(b)
    assert res["confirmed"]
    stops = [s for s in res["steps"] if not s["narrowed"]]
    assert len(stops) == 1 and stops[0]["p_value"] > 0.05 and stops[0]["tested"] == 500
    assert (stops[0]["first_fail"]["correct"], stops[0]["first_fail"]["n"]) == (6, 8)
    assert "stopped before the resolution of 8" in res["message"]
    assert res["bracket"] == (400, 600)


def test_a_passing_midpoint_moves_the_lower_end_and_a_failing_one_the_upper():
    down = _run(TableBisector(lambda n, i: n < 450, resolution=100))
    (step,) = [s for s in down["steps"] if s["tested"] is not None]
    assert step["tested"] == 500 and step["first_fail"]["length"] == 500 and down["bracket"] == (400, 500)
    up = _run(TableBisector(lambda n, i: n < 550, resolution=100))
    (step,) = [s for s in up["steps"] if s["tested"] is not None]
    assert step["tested"] == 500 and step["last_pass"]["length"] == 500 and up["bracket"] == (500, 600)


def test_no_bracket_messages_and_the_failed_length():
    assert "already 0.00 < 0.85 at 200 tokens; lower the shortest" in _no_bracket(
        {200: (0, 2)}, 200, 400, 0.85
    )
    assert "raise the longest" in _no_bracket({200: (2, 2)}, 200, 400, 0.85)
    assert "raise the longest" in _no_bracket({}, 200, 400, 0.85)
    b = TableBisector(lambda n, i: True, resolution=8)
    res = _run(b)
    assert res["bracket"] is None and res["crossing"] is None and "raise the longest" in res["message"]

    class Dead(TableBisector):
        def tally(self):
            t = super().tally()
            return {n: ((0, 0) if n == 600 else v) for n, v in t.items()}

    with pytest.raises(BadInput, match="every request at 600 tokens failed"):
        _run(Dead(lambda n, i: n < 733, resolution=8))


def test_crossing_statement():
    c = _crossing({400: (6, 6), 600: (0, 6)}, (400, 600), 0.85)
    assert c["confidence"] == pytest.approx(1 - 0.85**6 - 0.15**6)
    assert c["meaning"].startswith(
        "where this sample crossed 0.85: recall 6/6 [0.61, 1.00] at 400 tokens, 0/6"
    )
    assert "confidence 0.62" in c["meaning"]


def test_residue_runs_are_strata_and_corrected():
    b = TableBisector(lambda n, i: n % 4 != 3, resolution=8, residue_runs=3)
    res = _run(b, 200, 400, boundaries=(4, 10000))
    (mod4,) = res["residue"]
    assert mod4["strata"] == 3 and mod4["flagged"] == [3]
