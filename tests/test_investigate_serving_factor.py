"""Issue 52 part 4: the live route's ``--serving-factors`` step names the serving factor that
reproduces a loss, in ``verdicts.json``'s characterization (``state_dependent``, its numbers, the
command in ``next``) and in the DIAGNOSIS summary line; against a real scripted server whose
wrong answers need a prefix-cache hit. The measurement (``measure.serving_factors``) runs on a
session of the live route's shape (the rest of the live route needs the organism and is tested in
test_investigate_live.py); the decision (``decide.serving_factor``) merges it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from golden_findings import golden
from needlescope.analysis.factors import decide, decide_identity, identity_counts, paired_counts
from needlescope.investigate.decide.schema import VERDICTS_SCHEMA
from needlescope.investigate.decide.serving_factor import with_serving_factor
from needlescope.investigate.measure.serving_factors import measure_live_serving_factor
from needlescope.investigate.report.summary import _root_cause
from needlescope.schema import check_schema
from needlescope.testing.servers import scripted

UNDECIDED = {
    "classes": ["undecided"],
    "where": None,
    "evidence": {},
    "undecided": ["dense lengths (entries <= top-k) tell outside_selection from a selection bug"],
    "next": "needlescope probe ...",
    "text": "not among the suspects; the kind of bug is undecided: ...",
    "measured": {"baseline": "reference", "not_reproduced": 0, "rerun": 0, "cells": [], "layers": []},
}

NONE = {  # the symptom, each case alone and cold, lost nothing
    "classes": ["none"],
    "where": None,
    "evidence": {"none": {"rule": "no recall lost", "null": "a paired loss"}},
    "undecided": [],
    "next": None,
    "text": "nothing to explain: no recall lost",
}


def _session(url: str, out: Path, *, wanted: bool = True):
    """What the step reads of a live ``Session``: the ledger's target and symptom, the run
    directory, the key, progress, and whether the run asked for it."""
    ledger = SimpleNamespace(
        target=SimpleNamespace(live=True, endpoint=url),
        symptom=SimpleNamespace(kind="single", depths=(0.0, 50.0, 100.0), trials=2, seed=0, max_new_tokens=8),
    )
    done: dict = {}  # what RunState.step_value / mark_done keep
    state = SimpleNamespace(step_value=done.get, mark_done=done.__setitem__)
    return SimpleNamespace(
        ledger=ledger, out=out, api_key=None, progress=lambda *a: None, serving_factors=wanted, state=state
    )


@pytest.fixture(scope="module")
def cache_bug():
    with scripted(model="scripted", fault="near_miss", fault_when="cache_hit") as srv:
        yield srv.url


def _decided(session, characterization: dict) -> dict:
    """The characterization ``decide`` returns once the step measured (``with_serving_factor``)."""
    measured = measure_live_serving_factor(session, "scripted", [120])
    json.dumps(measured)  # a measurement state.json caches
    return with_serving_factor(characterization, measured)


def test_the_live_step_names_the_prefix_cache_and_the_summary_says_it(cache_bug, tmp_path):
    ch = _decided(_session(cache_bug, tmp_path), dict(UNDECIDED))
    check_schema(ch, VERDICTS_SCHEMA["properties"]["characterization"], "characterization")
    assert ch["classes"] == ["state_dependent"] and ch["undecided"] == []
    ev = ch["evidence"]["state_dependent"]
    assert ev["factor"] == "prefix cache" and ev["arm"] == "cache=warm"
    assert ev["pairs"] == 12 and ev["lost"] == 12 and ev["p_holm"] < 0.05  # 4 trials x 3 depths
    assert ch["next"].startswith("needlescope serving-factors --base-url " + cache_bug)
    assert "--lengths 120" in ch["next"] and "--trials 4" in ch["next"]
    body = json.loads((tmp_path / "serving_factors" / "serving_factors.json").read_text())
    assert (
        body["verdict"]["named"] == "cache"
        and ch["measured"]["serving_factors"]["requests"] == body["requests"]["sent"]
    )
    line = _root_cause(_clean(ch, 0.0))
    assert "depends on the serving state, prefix cache" in line and "cache=warm recall 0.00" in line
    assert line.endswith(f"next, `{ch['next']}`")


def test_a_healthy_endpoint_keeps_the_characterization_and_notes_the_power(tmp_path):
    with scripted(model="scripted") as srv:
        ch = _decided(_session(srv.url, tmp_path), dict(UNDECIDED))
    assert ch["classes"] == ["undecided"] and ch["next"] == UNDECIDED["next"]
    noted = ch["measured"]["serving_factors"]
    assert (
        noted["named"] is None
        and noted["sentence"].startswith("no factor")
        and noted["min_power"] is not None
    )


def _clean(findings_characterization: dict, recall_candidate: float):
    """A live ``Findings`` with no suspect, no root cause and this characterization."""
    return replace(
        golden("live-root-cause"),
        suspects=(),
        root_cause=None,
        root_causes=(),
        residual=None,
        unaccounted_differences=(),
        symptom={"recall_reference": {"120": 1.0}, "recall_candidate": {"120": recall_candidate}},
        characterization=findings_characterization,
    )


def test_the_step_runs_only_when_asked(cache_bug, tmp_path):
    assert measure_live_serving_factor(_session(cache_bug, tmp_path, wanted=False), "m", [120]) is None
    assert not (tmp_path / "serving_factors").exists()


def test_a_symptom_that_lost_nothing_alone_still_gets_the_factor_named(cache_bug, tmp_path):
    """The live symptom's captures run alone and cold: a loss that needs a warm prefix never
    shows there, so the step runs on a "none" characterization too and names the prefix cache."""
    ch = _decided(_session(cache_bug, tmp_path), dict(NONE))
    check_schema(ch, VERDICTS_SCHEMA["properties"]["characterization"], "characterization")
    assert ch["classes"] == ["state_dependent"] and "none" not in ch["evidence"]
    assert ch["evidence"]["state_dependent"]["factor"] == "prefix cache"
    assert ch["text"].startswith("the symptom's cases lose nothing alone and cold, but recall depends")
    assert ch["next"].startswith("needlescope serving-factors --base-url " + cache_bug)
    line = _root_cause(_clean(ch, 1.0))  # the symptom itself lost nothing: the line still names it
    assert "serving state, prefix cache" in line and line.endswith(f"next, `{ch['next']}`")


def test_an_output_departure_without_a_recall_loss_is_named_as_output_not_recall():
    """Recall holds in every state but greedy output departs at draft 4 on 9 of 12 cases (repeat:
    none): the class is ``state_dependent`` with the output evidence, and neither it nor the
    summary line calls it a recall loss."""
    same, moved = [False] * 12, [True] * 9 + [False] * 3
    recall = decide([{**paired_counts([True] * 12, [True] * 12), "arm": "draft=4", "factors": ["draft"]}])
    ident = decide_identity([{**identity_counts(moved, same), "arm": "draft=4", "factors": ["draft"]}])
    factors = {
        "verdict": {**{k: v for k, v in recall.items() if k != "tests"}, "sentence": "no factor: ..."},
        "tests": recall["tests"],
        "identity": {
            "reference": "repeat",
            "continuation": 32,
            "repeat_departs": 0,
            "repeat_pairs": 12,
            "tests": ident["tests"],
            "verdict": {
                **{k: v for k, v in ident.items() if k != "tests"},
                "sentence": "draft changes greedy output: ...",
            },
        },
        "requests": {"sent": 36},
        "command": "needlescope serving-factors --base-url http://x --model m --draft-depths 4 --continuation 32",
    }
    ch = with_serving_factor(dict(NONE), factors)
    check_schema(ch, VERDICTS_SCHEMA["properties"]["characterization"], "characterization")
    ev = ch["evidence"]["state_dependent"]
    assert ch["classes"] == ["state_dependent"] and ev["effect"] == "output departs"
    assert (ev["factor"], ev["departs"], ev["only_arm"], ev["only_repeat"]) == ("speculative", 9, 9, 0)
    assert ev["p_holm"] < 0.05 and "lost" not in ev
    assert "greedy output depends on the serving state, speculative" in ch["text"]
    assert "recall depends" not in ch["text"] and "no serving state loses recall" in ch["text"]
    line = _root_cause(_clean(ch, 1.0))
    assert "speculative" in line and line.endswith(f"next, `{factors['command']}`")
    assert ch["measured"]["serving_factors"]["output"] == "draft changes greedy output: ..."
