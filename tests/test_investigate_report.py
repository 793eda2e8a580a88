"""DIAGNOSIS from golden ``Findings`` (tests/golden_findings.py): the report renders from its input
alone, in milliseconds, on every route's result. The end-to-end runs that produce such findings
are tests/test_investigate_organism.py (in-process, rendered in Chromium), test_investigate_live.py
and test_investigate_dump.py."""

from __future__ import annotations

import dataclasses

import pytest

from golden_findings import golden, names, raw
from needlescope.investigate.decide.findings import Findings
from needlescope.investigate.report import diagnosis
from needlescope.investigate.report.diagnosis import FIX_OFFSET, diagnosis_blocks, write_reports


@pytest.mark.parametrize("name", names())
def test_every_golden_findings_round_trips_through_its_schema(name):
    obj = raw(name)
    assert Findings.from_json(obj).to_json() == obj


@pytest.mark.parametrize("name", names())
def test_every_golden_findings_renders_markdown_and_html(name, tmp_path):
    md, page = write_reports(golden(name, tmp_path))
    text = md.read_text()
    assert text.startswith("# DIAGNOSIS\n\n> **Summary**") and "## Verdicts" in text
    for s in golden(name).suspects:  # every verdict shown, with its reason
        assert f"| {s.id} |" in text and s.reason.split(";")[0][:60] in text
    assert "<html" in page.read_text()


def test_a_lift_that_is_not_significant_is_called_so_with_its_numbers(tmp_path):
    """Issue 54 item 15: index_topk 64 -> 128 lifts recall 0.44 -> 0.72 (b=5 c=0 p=0.0625); the
    table and the plot legend said "no effect"."""
    f = golden("in-process-root-cause", tmp_path)
    topk = next(x for x in f.fixes if x["name"] == "topk-128")
    assert (topk["pair"]["b"], topk["pair"]["c"], topk["label_kind"]) == (5, 0, "no effect")
    text = write_reports(f)[0].read_text()
    row = next(line for line in text.splitlines() if "index_topk 64 -> 128 |" in line)
    assert row.startswith("| not significant (p=0.062, n=18) |") and "no effect" not in row


def test_the_fix_curves_never_hide_under_the_reference_line():
    """Issue 54 item 15: a fix that restores recall to 1.00 was drawn on the reference's line."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = golden("in-process-root-cause")
    fig, ax = plt.subplots()
    diagnosis._recall_curves(ax, f)
    by_label = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    plt.close(fig)
    reference = by_label["reference"]
    fixes = [y for label, y in by_label.items() if label not in ("reference", "candidate")]
    assert len(fixes) == len(f.fixes) >= 2
    assert any(x["recall_by_length"] == f.symptom["recall_reference"] for x in f.fixes)  # one equals it
    for y in fixes:
        assert min(abs(a - b) for a, b in zip(y, reference)) >= FIX_OFFSET - 1e-9
    for i, a in enumerate(fixes):  # nor under each other
        for b in fixes[i + 1 :]:
            assert a != b
    legend = [t for t in by_label if "topk-128" in t]
    assert legend == ["topk-128: not significant (p=0.062, n=18) (drawn -0.140)"]


def test_the_report_reads_the_role_never_the_reason():
    f = golden("in-process-root-cause")
    workaround = next(s for s in f.suspects if s.role == "workaround")
    rows = {r[1]: r for b in diagnosis_blocks(f, []) if b[0] == "table" and b[1][0] == "tier" for r in b[2]}
    assert rows[workaround.id][3] == "workaround"
    plain = dataclasses.replace(workaround, role=None)  # the same reason without the role
    f2 = dataclasses.replace(f, suspects=tuple(plain if s.id == plain.id else s for s in f.suspects))
    rows = {r[1]: r for b in diagnosis_blocks(f2, []) if b[0] == "table" and b[1][0] == "tier" for r in b[2]}
    assert rows[workaround.id][3] == workaround.verdict
