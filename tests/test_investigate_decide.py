"""Decide once: measuring records evidence and pairs, ``decide`` turns them into verdicts in one
place, and ``run_investigation`` returns ``Findings`` whose two artifacts are written once each
and follow their schemas."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

import needlescope.investigate.run as run_module
from needlescope.investigate.decide.causal import decide_suspects
from needlescope.investigate.decide.findings import Findings, validate_findings
from needlescope.investigate.decide.verdicts import paired
from needlescope.investigate.ledger.example import EXAMPLE_LEDGER, write_example
from needlescope.investigate.run import run_investigation


def _measured(sid: str, *, present=True, pair=None, sufficiency=None, blocked=(), ran=0) -> dict:
    return {
        "id": sid,
        "tier": 1,
        "hypothesis": "h",
        "maps_to": "index_k=fp8_e4m3",
        "changes_topk": False,
        "auto": False,
        "present": present,
        "pair": pair,
        "divergence": 0.0 if pair else None,
        "sufficiency": sufficiency,
        "absent_by_question": None,
        "blocked": list(blocked),
        "ran_checks": ran,
        "presence": "config check: present",
        "questions": "",
    }


def _pair(wrong_with: int, right_with: int, n: int = 40) -> dict:
    """with = the candidate (wrong on ``wrong_with`` cases the other gets right), without = the removal."""
    ids = [f"c{i}" for i in range(n)]
    with_ok = {c: not (i < wrong_with) for i, c in enumerate(ids)}
    without_ok = {c: not (wrong_with <= i < wrong_with + right_with) for i, c in enumerate(ids)}
    return paired(with_ok, without_ok)


MEASURED = [
    _measured("cause", pair=_pair(20, 0), sufficiency=_pair(18, 0), ran=1),
    _measured("bystander", pair=_pair(1, 1), ran=1),
    _measured("absent", present=False),
    _measured("unrun", blocked=["ablation: reference checkpoint unavailable"]),
]


def test_decide_is_pure_and_decides_every_verdict_once():
    before = copy.deepcopy(MEASURED)
    suspects, meta = decide_suspects(MEASURED, loss=0.5, signature_fires=False)
    assert MEASURED == before  # nothing measured is changed: no provisional verdict to revise
    assert all("verdict" not in m and "reason" not in m for m in MEASURED)
    assert decide_suspects(MEASURED, 0.5, False) == (suspects, meta)  # a second call decides nothing new
    by = {s["id"]: s for s in suspects}
    assert by["cause"]["verdict"] == "implicated" and meta["root_cause"] == "cause"
    assert by["cause"]["role"] == "root cause" and by["cause"]["sufficient"] is True
    # the sufficiency clause is part of the one reason, once
    assert by["cause"]["reason"].count("added alone to the reference at the deployment index_topk") == 1
    assert by["absent"]["verdict"] == "exonerated" and by["unrun"]["verdict"] == "blocked"
    assert meta["multiplicity"] == {"method": "holm", "tests": 2, "alpha": 0.05}
    assert all("blocked" not in s and "ran_checks" not in s for s in suspects)  # evidence stays behind


@pytest.fixture
def blocked_run(tmp_path, monkeypatch):
    """The example ledger against a checkpoint that does not exist: questions run, every model
    check is blocked, and the run still ends in Findings (fast: no model is loaded)."""
    write_example(tmp_path)
    ledger = tmp_path / "investigation.toml"
    ledger.write_text(EXAMPLE_LEDGER.replace('model = "organism"', f'model = "{tmp_path / "no-such-model"}"'))
    writes: list[str] = []
    real = run_module.atomic_write_json

    def spy(path, obj):
        writes.append(path.name)
        real(path, obj)

    monkeypatch.setattr(run_module, "atomic_write_json", spy)
    findings = run_investigation(ledger, tmp_path / "out")
    return findings, writes, tmp_path / "out"


def test_run_returns_findings_and_writes_each_artifact_once(blocked_run):
    findings, writes, out = blocked_run
    assert sorted(writes) == ["investigation.json", "verdicts.json"]
    assert json.loads((out / "verdicts.json").read_text()) == findings.verdicts
    assert json.loads((out / "investigation.json").read_text()) == findings.to_json()
    assert Findings.read(out) == findings
    assert Findings.from_json(findings.to_json(), out=out, ledger_sha256=findings.ledger_sha256) == findings
    assert {s.verdict for s in findings.suspects} <= {"blocked", "exonerated"}
    assert any("reference checkpoint unavailable" in s.reason for s in findings.suspects)
    # what the measuring step kept per suspect is evidence, never a verdict
    state = json.loads((out / "state.json").read_text())
    measured = [v for k, v in state["done"].items() if k.startswith("measured:")]
    assert measured and all("verdict" not in m for m in measured)


def test_findings_schema_refuses_a_broken_investigation(blocked_run):
    findings, _, _ = blocked_run
    validate_findings(findings.to_json())
    broken = copy.deepcopy(findings.to_json())
    del broken["configs"]
    with pytest.raises(ValueError, match="missing key 'configs'"):
        Findings.from_json(broken)  # checked when read
    broken = copy.deepcopy(findings.to_json())
    broken["verdicts"]["suspects"][0]["verdict"] = "guilty"
    with pytest.raises(ValueError, match="guilty"):
        Findings.from_json(broken)
    with pytest.raises(ValueError, match="guilty"):  # and when written
        dataclasses.replace(
            findings, suspects=(dataclasses.replace(findings.suspects[0], verdict="guilty"),)
        ).to_json()
