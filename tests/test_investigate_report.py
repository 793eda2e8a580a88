"""DIAGNOSIS from golden ``Findings`` (tests/golden_findings.py): the report renders from its input
alone, in milliseconds, on every route's result. The end-to-end runs that produce such findings
are tests/test_investigate_organism.py (in-process, rendered in Chromium), test_investigate_live.py
and test_investigate_dump.py."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest

from golden_findings import golden, names, raw
from needlescope.investigate.decide.findings import Findings
from needlescope.investigate.report import diagnosis
from needlescope.investigate.report.diagnosis import FIX_OFFSET, diagnosis_blocks, write_reports


@pytest.mark.parametrize("name", names())
def test_every_golden_findings_round_trips_through_its_schema(name):
    obj = raw(name)
    assert Findings.from_json(obj).to_json() == obj


@pytest.mark.parametrize("name", [n for n in names() if not n.startswith("class-")])
def test_every_golden_findings_renders_markdown_and_html(name, tmp_path):
    """Every route's golden, plots and HTML included (the class goldens share one run's findings
    but for the characterization: tests/test_golden_decide.py renders their section, in ms)."""
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


def _screenshot(page, shot, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is missing: run 'make deps'"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            f"--window-size=1200,{height}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def test_diagnosis_html_renders_in_headless_chromium(tmp_path):
    """DIAGNOSIS.html (plots embedded) of `make demo`'s golden findings screenshotted by Debian's
    chromium: not blank, plots drawn, and the summary box, root cause inside, whole within the
    first 1000 px. (It rendered a fresh organism investigation before the golden findings.)"""
    import numpy as np
    from matplotlib.image import imread

    from needlescope.report.blocks import SUMMARY_BACKGROUND, SUMMARY_BORDER

    findings = golden("in-process-root-cause", tmp_path)
    md, page = write_reports(findings, command="needlescope investigate run L --out O")
    text = md.read_text()
    assert (
        "**triton_paged_indexer**" in text and "root-cause fix" in text and "needle entries selected" in text
    )
    assert text.startswith("# DIAGNOSIS\n\n> **Summary**")
    html = page.read_text()
    assert "data:image/png;base64," in html
    box = html[html.index('<section class="summary">') : html.index("</section>")]
    assert "Root cause</dt><dd><strong>triton_paged_indexer</strong>" in box and "Recommended fix" in box
    assert html.index('<section class="summary">') < html.index("<h2>Symptom</h2>")
    assert "<details><summary>Evidence: " in html  # folded
    sha = findings.ledger_sha256
    footer = html[html.index('<footer class="footer">') :]
    assert (
        sha in footer
        and "needlescope 0." in footer
        and " UTC " in footer
        and "investigate run L --out O" in footer
    )
    shot = tmp_path / "shot.png"
    _screenshot(page, shot, 1600)
    img = imread(shot)[..., :3]  # [H, W, 3] floats in 0..1
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000
    ink = (img.min(axis=-1) < 0.8).mean()  # text, table borders, plot lines
    colour = ((img.max(axis=-1) - img.min(axis=-1)) > 0.3).mean()  # the plots' coloured lines
    assert ink > 0.01, f"screenshot is (nearly) blank: {ink:.4f} of pixels inked"
    assert colour > 0.0005, f"no coloured pixels: the embedded plots did not render ({colour:.5f})"
    assert len(np.unique((img * 255).astype(int).reshape(-1, 3), axis=0)) > 50
    # The first screen: the box's fill and both of its horizontal borders lie in the top 1000 px.
    first = tmp_path / "first.png"
    _screenshot(page, first, 1000)
    px = np.rint(imread(first)[..., :3] * 255).astype(int)
    assert px.shape[0] == 1000

    def rgb(h: str) -> np.ndarray:
        return np.array([int(h[i : i + 2], 16) for i in (1, 3, 5)])

    fill = np.where((np.abs(px - rgb(SUMMARY_BACKGROUND)).max(-1) <= 2).mean(1) > 0.3)[0]
    edge = np.where((np.abs(px - rgb(SUMMARY_BORDER)).max(-1) <= 2).mean(1) > 0.5)[0]
    assert fill.size > 100, "no summary box in the first screen"
    assert edge.size and edge.min() < fill.min() and fill.max() < edge.max() < 1000, (
        edge,
        fill.min(),
        fill.max(),
    )


def test_a_blocked_run_says_what_blocked_each_check(tmp_path):
    f = golden("in-process-blocked", tmp_path)
    text = write_reports(f)[0].read_text()
    assert "no candidate recall was measured" in text
    blocked = text[text.index("## Blocked or unrun diagnostics") :]
    assert all(f"{s.id}: " in blocked for s in f.suspects if s.verdict == "blocked")
    assert "reference checkpoint unavailable" in blocked


def test_a_dump_run_shows_where_the_divergence_starts_and_no_fix(tmp_path):
    f = golden("dump-localized", tmp_path)
    text = write_reports(f)[0].read_text()
    assert f.route == "dump" and f.localization["diverges_first"] == "dump"
    assert "the candidate is an engine tensor dump of one request" in text
    assert "a tensor dump cannot be ablated" in text and "## Fixes" not in text


def test_a_live_run_shows_each_emulation_against_the_live_capture(tmp_path):
    f = golden("live-root-cause", tmp_path)
    text = write_reports(f)[0].read_text()
    section = text[text.index("## Live selection vs each suspect's emulation") :]
    for s in f.suspects:
        if s.live:
            assert f"| {s.id} | {s.verdict} | {s.live['reproduced']} of {s.live['failures']} |" in section
    assert "none measured: a live endpoint cannot be ablated" in text and "## Fixes" not in text
