"""The bisection's decisions in-process: a bisector whose 'server' is a table of outcomes per
length and trial (deterministic), so every step, escalation and stop is checked exactly. The
real-server tests are tests/test_bisect.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from needlescope.errors import BadInput, ProbeError
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
    assert res["message"] == (
        "recall falls below 0.85 between 400 and 600 tokens (stopped before the resolution of 8: a step's "
        f"ends did not differ significantly with up to 8 cases a length); {res['crossing']['meaning']}"
    )
    assert res["bracket"] == (400, 600)


def test_a_passing_midpoint_moves_the_lower_end_and_a_failing_one_the_upper():
    down = _run(TableBisector(lambda n, i: n < 450, resolution=100))
    (step,) = [s for s in down["steps"] if s["tested"] is not None]
    assert step["tested"] == 500 and step["first_fail"]["length"] == 500 and down["bracket"] == (400, 500)
    # A bracket exactly the resolution wide has reached it.
    assert down["message"] == (
        f"recall falls below 0.85 between 400 and 500 tokens (resolution 100); {down['crossing']['meaning']}"
    )
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

    with pytest.raises(ProbeError, match="every request at 600 tokens failed"):
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
    # The bisection's alpha is the residue tests' too.
    (strict,) = _run(
        TableBisector(lambda n, i: n % 4 != 3, resolution=8, residue_runs=3, alpha=1e-6), 200, 400, (4,)
    )["residue"]
    assert strict["p_value"] == mod4["p_value"] > 1e-6 and strict["flagged"] == []


def test_residue_moduli_from_2_to_the_largest_and_runs_below_the_bracket():
    from needlescope.analysis.bisect import RESIDUE_MAX_MOD

    b = TableBisector(lambda n, i: n < 733, resolution=8)
    res = _run(b, boundaries=(1, 2, RESIDUE_MAX_MOD, RESIDUE_MAX_MOD + 1))
    assert [t["modulus"] for t in res["residue"]] == [2, RESIDUE_MAX_MOD]
    residue = [e for name, e in b.events if name == "evaluate" and e["phase"].startswith("residue")]
    assert [e["phase"] for e in residue] == ["residue mod 2", f"residue mod {RESIDUE_MAX_MOD}"]
    # The runs stay at or below the last passing length.
    assert max(n for e in residue for n in e["lengths"]) == res["bracket"][0]


def test_bisect_config_defaults_and_each_bound():
    d = BisectConfig()
    assert (d.resolution, d.ci_width, d.coarse_points, d.boundaries, d.residue_runs, d.alpha, d.max_trials) == (
        16, None, 5, None, 3, 0.05, None,
    )  # fmt: skip
    BisectConfig(resolution=1, ci_width=0.5, coarse_points=2, alpha=0.5, max_trials=1, boundaries=(1,))
    bad = {
        "resolution": (0, r"--resolution must be at least 1 token; got 0"),
        "ci_width": (1.0, r"--ci-width must lie in \(0, 1\); got 1.0"),
        "coarse_points": (1, r"--coarse-points must be at least 2; got 1"),
        "alpha": (1.0, r"alpha must lie in \(0, 1\); got 1.0"),
        "max_trials": (0, r"max_trials must be at least 1; got 0"),
        "boundaries": ((4, 0), r"--boundaries must be positive token counts; got \[4, 0\]"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(BadInput, match=f"^{message}$"):
            BisectConfig(**{key: value})
    for key, value in [("ci_width", 0.0), ("alpha", 0.0)]:
        with pytest.raises(BadInput):
            BisectConfig(**{key: value})


def test_trials_from_the_interval_width_and_the_cap(tmp_path):
    cfg = SimpleNamespace(trials=1, threshold=0.85, depths=(0, 100), haystack_file=None)
    # (2 x 1.96)^2 x 0.85 x 0.15 / 0.2^2 = 48.98: 49 cases a length, 25 trials over 2 depths
    b = _Bisector(cfg, BisectConfig(ci_width=0.2), None, None, None, None)
    assert (b.trials, b.max_trials, b.per_point, b.haystack) == (25, 100, 50, None)
    assert _Bisector(cfg, BisectConfig(ci_width=0.2, max_trials=30), None, None, None, None).max_trials == 30
    # more --trials than the width asks for: kept; no width: the --trials, 4 x as the cap
    many = SimpleNamespace(**{**vars(cfg), "trials": 40})
    assert _Bisector(many, BisectConfig(ci_width=0.2), None, None, None, None).trials == 40
    (tmp_path / "h.txt").write_text("hay", encoding="utf-8")
    plain = _Bisector(
        SimpleNamespace(**{**vars(cfg), "trials": 3, "haystack_file": tmp_path / "h.txt"}),
        BisectConfig(),
        *[None] * 4,
    )
    assert (plain.trials, plain.max_trials, plain.haystack) == (3, 12, "hay")


def test_points_and_the_range_check():
    from needlescope.analysis.stats import wilson_interval
    from needlescope.run.bisect import _check_range, _points

    lo, hi = wilson_interval(3, 4)
    assert _points({400: (3, 4), 600: (0, 0)}, {400: "coarse"}) == [
        {"length": 400, "phase": "coarse", "n": 4, "correct": 3, "recall": 0.75, "ci_low": lo, "ci_high": hi},
        {"length": 600, "phase": "?", "n": 0, "correct": 0, "recall": None, "ci_low": 0.0, "ci_high": 1.0},
    ]
    _check_range((200, 202))
    with pytest.raises(
        BadInput, match=r"--bisect needs a range: give --lengths LO,HI with HI > LO \+ 1; got \[201, 200\]"
    ):
        _check_range((201, 200))


def test_run_bisect_refuses_graded_scoring_and_a_range_too_short_before_any_request(tmp_path):
    from needlescope.run.bisect import run_bisect
    from needlescope.run.config import ProbeConfig

    base = dict(base_urls=("http://127.0.0.1:9/v1",), model="m", out=tmp_path / "o", lengths=(200, 400))
    for flag in ("graded", "auto_difficulty"):
        with pytest.raises(BadInput, match="^--bisect measures recall only"):
            run_bisect(ProbeConfig(**base, **{flag: True}), BisectConfig())
    with pytest.raises(BadInput, match="--bisect needs a range"):
        run_bisect(ProbeConfig(**{**base, "lengths": (200, 201)}), BisectConfig())


def test_a_midpoint_exactly_at_the_threshold_passes():
    # 17 of 20 cases right at the midpoint 500 is recall 0.85, which passes (>=): the bracket
    # moves up to (500, 600) rather than down to (400, 500).
    b = TableBisector(lambda n, i: n < 500 or (n == 500 and i % 20 < 17), trials=10, resolution=100)
    res = _run(b)
    assert res["bracket"] == (500, 600) and res["confirmed"]
    (step,) = [s for s in res["steps"] if s["tested"] == 500]
    assert step["last_pass"]["length"] == 500 and step["last_pass"]["correct"] == 17 and step["narrowed"]


def test_an_end_that_stops_bracketing_after_more_trials_stops_the_step():
    # The lower end passes on 2 cases (2/2) and fails on 4 (2/4): no longer a bracket, so the
    # step stops there, untested (p recorded as 1), not escalated further.
    low = _run(TableBisector(lambda n, i: n < 600 and not (n == 400 and i >= 2), resolution=8))
    (step,) = low["steps"]
    assert (step["p_value"], step["narrowed"], step["tested"]) == (1.0, False, None)
    assert (step["last_pass"]["correct"], step["last_pass"]["n"], step["first_fail"]["n"]) == (2, 4, 4)
    assert not low["confirmed"] and low["bracket"] == (400, 600)
    assert low["message"] == (
        "recall crosses 0.85 between 400 and 600 tokens in this sample, but the two do not differ "
        "significantly (Fisher p=1 with 4 cases at 600): not narrowed; raise --trials; "
        + low["crossing"]["meaning"]
    )
    # The upper end fails on 10 cases (8/10) and passes on 20 (17/20): the same.
    wrong = {0, 1, 10, 20, 21, 22}
    up = _run(TableBisector(lambda n, i: n < 600 or (n == 600 and i not in wrong), trials=5, resolution=8))
    (step,) = up["steps"]
    assert (step["p_value"], step["narrowed"]) == (1.0, False)
    assert (step["first_fail"]["correct"], step["first_fail"]["n"]) == (17, 20) and not up["confirmed"]


def test_passes_needs_cases_and_compares_inclusively():
    from needlescope.run.bisect import _passes

    assert not _passes({}, 400, 0.85) and not _passes({400: (0, 0)}, 400, 0.85)
    assert _passes({400: (1, 1)}, 400, 0.85) and _passes({400: (17, 20)}, 400, 0.85)
    assert not _passes({400: (16, 20)}, 400, 0.85)


def test_no_bracket_messages_whole():
    assert _no_bracket({200: (1, 2)}, 200, 400, 0.85) == (
        "cannot bracket a boundary in [200, 400]: recall is already 0.50 < 0.85 at 200 tokens; "
        "lower the shortest --lengths"
    )
    assert _no_bracket({200: (17, 20)}, 200, 400, 0.85) == (
        "cannot bracket a boundary in [200, 400]: recall stays at or above 0.85 at every tested "
        "length; raise the longest --lengths"
    )


def test_a_midpoint_with_no_scored_case_cannot_be_bisected():
    class Missing(TableBisector):
        def tally(self):
            return {n: v for n, v in super().tally().items() if n != 700}

    with pytest.raises(
        ProbeError, match=r"^every request at 700 tokens failed; the server cannot be bisected$"
    ):
        _run(Missing(lambda n, i: n < 733, resolution=8))
