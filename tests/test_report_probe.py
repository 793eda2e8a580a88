"""Tests for needlescope.report.probe, rendering what needlescope.analysis.probe_summary decides."""

import json

import pytest

from needlescope.analysis import cells_from_results
from needlescope.analysis.depth import depth_profile
from needlescope.analysis.probe_summary import analyze_probe
from needlescope.report import validate_summary, write_probe_outputs


def test_writes_four_files(tmp_path):
    results = []
    for length in (1000, 2000):
        for depth in (0.0, 50.0, 100.0):
            for t in range(3):
                ok = not (length == 2000 and t == 0)
                results.append(
                    {"case_id": f"single-L{length}-D{depth:g}-T{t}", "length": length, "depth": depth,
                     "status": "ok" if t != 2 or length == 1000 else "error",
                     "correct": ok if t != 2 or length == 1000 else None,
                     "counted_length": length if t != 1 else length + 1}
                )  # fmt: skip
    cells = cells_from_results(results)
    analysis = analyze_probe(
        cells=cells, results=results, kind="single", model="m", threshold=0.9,
        provenance={"tool": "needlescope"}, value_digits=3, value_digits_source="--value-digits",
    )  # fmt: skip
    summary = write_probe_outputs(tmp_path, analysis, cells=cells, results=results, notes=["a note"])
    for name in ("summary.json", "report.md", "heatmap.png", "results.jsonl"):
        assert (tmp_path / name).stat().st_size > 0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    validate_summary(on_disk)
    assert on_disk == summary
    assert summary["effective_length"] == 1000
    assert summary["cliff"]["from"] == 1000 and summary["cliff"]["to"] == 2000
    assert summary["errors_total"] == 3 and summary["length_mismatches"] == 6
    assert summary["value_digits"] == 3 and summary["cells_without_data"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "WARNING" in md and "3 request(s) failed" in md and "a note" in md
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(results)
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_rejects_bad():
    with pytest.raises(ValueError):
        validate_summary({"threshold": 0.9})
    good = {"headline": [], "effective_length": None, "threshold": 0.9, "kind": "k", "model": "m", "cells": [],
            "cliff": None, "depth_profile": depth_profile([]), "provenance": {}}  # fmt: skip
    validate_summary(good)
    with pytest.raises(ValueError):
        validate_summary({**good, "effective_length": "100"})


def _write(tmp_path, results, cells):
    analysis = analyze_probe(
        cells=cells, results=results, kind="single", model="m", threshold=0.9, provenance={},
        value_digits=7, value_digits_source="--value-digits",
    )  # fmt: skip
    return write_probe_outputs(tmp_path, analysis, cells=cells, results=results, notes=[])


def test_a_cell_where_every_request_failed_is_null_and_drawn_as_no_data(tmp_path):
    results = [
        {"case_id": f"c{n}-{t}", "length": n, "depth": 50.0, "counted_length": n,
         "status": "ok" if n == 256 else "error", "correct": True if n == 256 else None}
        for n in (256, 512) for t in range(2)
    ]  # fmt: skip
    summary = _write(tmp_path, results, cells_from_results(results))
    validate_summary(json.loads((tmp_path / "summary.json").read_text()))
    assert [c["recall"] for c in summary["cells"]] == [1.0, None]
    assert summary["cells_without_data"] == 1 and summary["cliff"] is None
    md = (tmp_path / "report.md").read_text()
    assert "| 512 | 50 | no data |" in md and "no scored case" in md


def test_server_count_disagreement_is_a_length_mismatch_with_a_warning(tmp_path):
    # Seen against transformers serve: every case counted 256, the server said 253, and no WARNING.
    results = [
        {"case_id": f"c{t}", "length": 256, "depth": 0.0, "counted_length": 256, "prompt_tokens": 253,
         "status": "ok", "correct": True}
        for t in range(3)
    ]  # fmt: skip
    summary = _write(tmp_path, results, cells_from_results(results))
    assert summary["length_mismatches"] == 3 and summary["server_length_mismatches"] == 3
    assert summary["unreachable_lengths"] == 0
    assert "WARNING: 3 case(s) have a length disagreement" in (tmp_path / "report.md").read_text()
