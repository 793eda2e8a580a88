"""A bug the ledger does not name, on the organism (CPU): found as an automatic suspect, implicated,
and its non-finite scores counted; the same bug named in the ledger is implicated by name.

The candidate is the reference (fp32 keys, top-16) plus one model patch that drops every
candidate past a buffer of 8 entries (scored -inf) and leaves one slot per 16-entry page
unwritten (NaN). Multiturn at 256 tokens (64 entries), needles at depths 10-70% (past the buffer,
before the sliding window), 8 cases.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")

PATCH = """
from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, kv, hs):
            s = inner(q, kv, hs)
            s[..., 8:] = float("-inf")  # a candidate buffer of 8 entries
            s[..., 15::16] = float("nan")  # one unwritten slot per page
            return s
        return forward
    return wrap_scorers(model, wrap)
"""

LEDGER = """
[target]
model = "organism"
threads = 2
reference = "k=fp32 q=fp32 acc=fp32 topk=16"
candidate = "k=fp32 q=fp32 acc=fp32 topk=16"
extra_patches = ["patches/buffer.py"]

[symptom]
kind = "multiturn"
lengths = [256]
depths = [10, 20, 30, 40, 50, 60, 70, 35]
trials = 1
max_new_tokens = 4

[[suspects]]
id = "index_keys_fp8"
tier = 1
hypothesis = "fp8 keys"
setting = "k=fp8_e4m3"
checks = []
"""

NAMED = """
[[suspects]]
id = "buffer"
tier = 2
hypothesis = "the candidate buffer drops entries"
patch = "patches/buffer.py"
checks = ["ablation"]
"""


@pytest.fixture(scope="module")
def organism():
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle("organism")[:2]


def _run(d, named: bool, organism, seed=None) -> dict:
    from needlescope.investigate.report.diagnosis import write_reports
    from needlescope.investigate.run import run_investigation

    (d / "patches").mkdir(parents=True)
    (d / "patches" / "buffer.py").write_text(PATCH)
    (d / "investigation.toml").write_text(LEDGER + (NAMED if named else ""))
    if seed is not None:
        (d / "out" / "measure").mkdir(parents=True)
        shutil.copy(seed, d / "out" / "measure" / "reference.jsonl")
    write_reports(run_investigation(d / "investigation.toml", d / "out", loaded=organism))
    return json.loads((d / "out" / "verdicts.json").read_text())


@pytest.fixture(scope="module")
def unnamed(built_once, request):
    """The unnamed-patch investigation, run once per test run even when xdist gives this module's
    tests to both workers (it was computed twice in CI: 59 s and 56 s of setup)."""
    d = built_once("investigate-unnamed", lambda d: _run(d, False, request.getfixturevalue("organism")))
    return d, json.loads((d / "out" / "verdicts.json").read_text())


def test_an_unnamed_patch_becomes_an_automatic_suspect_and_the_root_cause(unnamed):
    d, v = unnamed
    (diff,) = v["unaccounted_differences"]
    assert diff == {
        "kind": "patch",
        "name": "patches/buffer.py",
        "reference": None,
        "candidate": "patches/buffer.py",
        "covered_by": [],
        "suspect": "auto:patches/buffer.py",
        "testable": True,
        "verdict": "implicated",
    }
    auto = next(s for s in v["suspects"] if s["id"] == "auto:patches/buffer.py")
    assert auto["auto"] and auto["necessary"] and auto["sufficient"] and auto["role"] == "root cause"
    assert v["root_cause"] == "auto:patches/buffer.py" and not v["residual"]["loses"]
    # nobody named it, so the localizer shows where it acts: the scorer its patch wraps
    loc = v["localization"]
    assert loc["diverges_first"] == "prefill" and loc["paths"][0]["module_type"] == "DeepseekV4IndexerScorer"
    assert loc["command"].startswith(
        "needlescope indexer diff --model organism --input-ids localize/input_ids.json"
    )
    md = (d / "out" / "DIAGNOSIS.md").read_text()
    assert md.index("## Differences the ledger did not name") < md.index("## Symptom")
    assert "`patches/buffer.py`" in md and "auto:patches/buffer.py" in md
    assert "Holm-adjusted" in md
    text = json.dumps(v) + (d / "out" / "investigation.json").read_text() + md
    assert str(d) not in text  # no absolute path of this machine in the artifacts


def test_non_finite_scores_are_counted_and_reported_not_a_crash(unnamed):
    d, v = unnamed
    counts = v["nonfinite_scores"]["counts"]["candidate"]
    assert set(counts) == {"1", "3"}  # both CSA layers
    assert all(c["neg_inf"] > 0 and c["nan"] > 0 and c["pos_inf"] == 0 for c in counts.values())
    assert "reference" not in v["nonfinite_scores"]["counts"]
    f = v["nonfinite_scores"]["findings"][0]
    assert f["nan"] > 0 and f["position"] is not None and f["case_id"].startswith("multiturn-L256")
    md = (d / "out" / "DIAGNOSIS.md").read_text()
    assert "## Non-finite indexer scores" in md and f"| candidate | 1 | {counts['1']['neg_inf']} |" in md


def test_the_same_bug_named_in_the_ledger_is_implicated_by_name(tmp_path, unnamed, organism):
    d0, _ = unnamed
    v = _run(tmp_path, True, organism, seed=d0 / "out" / "measure" / "reference.jsonl")
    assert v["unaccounted_differences"] == [] and v["root_cause"] == "buffer"
    assert next(s for s in v["suspects"] if s["id"] == "buffer")["role"] == "root cause"


def test_a_resumed_run_after_a_rule_change_decides_anew(tmp_path, unnamed, organism, monkeypatch):
    """Issue 51: state.json caches measurements, never a decision. The same run directory resumed
    after a rule changes (here the departure threshold of the localization, and the
    characterization's rules) measures nothing again and shows the new rule's decisions."""
    from needlescope.investigate.decide import decision, localization
    from needlescope.investigate.run import run_investigation

    d0, v0 = unnamed
    shutil.copytree(d0, tmp_path / "d")
    out = tmp_path / "d" / "out"
    measured = {p.name: p.read_bytes() for p in (out / "measure").iterdir()}
    departing = [p["first_departing_layer"] for p in v0["localization"]["paths"]]
    assert any(x is not None for x in departing), departing
    assert (
        v0["characterization"] is not None
        and "measured:characterization" in json.loads((out / "state.json").read_text())["done"]
    )
    monkeypatch.setattr(localization, "DEPARTS", 0.0)  # the new rule: no selection departs
    # ... and no module departs on the decode path, whatever its difference (it was decided at
    # measurement time and cached before issue 51's last part)
    monkeypatch.setattr(localization, "module_limit", lambda indexer, reference: float("inf"))
    real = decision.characterize
    monkeypatch.setattr(
        decision, "characterize", lambda ev, ctx: {**real(ev, ctx), "text": "by the new rules"}
    )
    findings = run_investigation(tmp_path / "d" / "investigation.toml", out, loaded=organism)
    assert [p["first_departing_layer"] for p in findings.localization["paths"]] == [None] * len(departing)
    decode = next(p for p in findings.localization["paths"] if p["path"] == "decode")
    before = next(p for p in v0["localization"]["paths"] if p["path"] == "decode")
    assert before["diverges"] and before["own_budget"] is not None, before  # the old rule: departs
    assert (
        not decode["diverges"] and decode["first_divergent_module"] is None and decode["own_budget"] is None
    )
    assert findings.characterization["text"] == "by the new rules"
    assert {p.name: p.read_bytes() for p in (out / "measure").iterdir()} == measured  # nothing measured again
