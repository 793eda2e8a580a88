"""``decide`` from golden ``Measured`` (tests/golden_measured.py), without a model: each captured
run's measurements decide to its golden ``Findings``, every characterization class the
investigation can decide has a golden of its own that ``decide`` still makes, and the report
renders each class from its golden ``Findings`` alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from golden_findings import golden, raw
from golden_findings import names as finding_names
from golden_measured import decided, measured, names
from needlescope.investigate.decide.characterize import VOCABULARY
from needlescope.investigate.decide.measured import Measured
from needlescope.investigate.report.diagnosis import diagnosis_blocks
from needlescope.report.blocks import render_md

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_goldens import class_measured  # noqa: E402

BASE = "in-process-unnamed"
"""The captured run the class goldens are made from (tests/golden/measured/README.md)."""


def _golden_name(cls: str) -> str:
    return f"class-{cls.replace('_', '-')}"


@pytest.mark.parametrize("name", names())
def test_a_golden_measured_round_trips_and_decides_to_its_golden_findings(name):
    m = measured(name)
    assert Measured.from_json(m.to_json()) == m
    assert decided(m, name) == raw(name)


@pytest.fixture(scope="module")
def by_class():
    return class_measured(measured(BASE))


def test_every_class_of_the_vocabulary_has_a_golden():
    assert {_golden_name(c) for c in VOCABULARY} <= set(finding_names())


@pytest.mark.parametrize("cls", VOCABULARY)
def test_each_class_decides_from_its_golden_measured(cls, by_class):
    expected = raw(_golden_name(cls))
    assert expected["verdicts"]["characterization"]["classes"][0] == cls
    assert decided(by_class[cls], BASE) == expected


@pytest.mark.parametrize("cls", VOCABULARY)
def test_the_report_names_each_class_from_its_golden_findings(cls):
    findings = golden(_golden_name(cls))
    text = render_md(diagnosis_blocks(findings, []))
    ch = findings.characterization
    assert "## What kind of bug" in text and ch["text"] in text
    for c in ch["evidence"]:
        assert f"| `{c}` |" in text
