import json

import pytest

from needlescope.analysis import cells_from_results
from needlescope.report.probe import validate_summary, write_probe_outputs


def test_writes_four_outputs_matching_the_schema(tmp_path):
    rows = [
        {"case_id": f"c{L}-{d}", "length": L, "depth": d, "status": "ok", "correct": L < 2000}
        for L in (1000, 2000)
        for d in (0, 50, 100)
    ] + [{"case_id": "e", "length": 1000, "depth": 0, "status": "error", "correct": None}]
    summary = write_probe_outputs(
        tmp_path,
        cells=cells_from_results(rows),
        results=rows,
        kind="single",
        model="m",
        threshold=0.85,
        provenance={"/v1/models": {"data": []}},
        notes=["c1000-0: requested 1000 tokens but the tokenizer counted 999"],
    )
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    validate_summary(on_disk)
    assert on_disk["effective_length"] == 1000 and on_disk["errors_total"] == 1
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(rows)
    report = (tmp_path / "report.md").read_text()
    assert "WARNING" in report and "1 failed requests" in report


def test_validate_summary_names_the_broken_field():
    with pytest.raises(ValueError, match="summary.cells\\[0\\]: missing key 'recall'"):
        validate_summary(
            {
                "effective_length": None,
                "threshold": 0.85,
                "kind": "single",
                "model": "m",
                "cells": [
                    {"length": 1, "depth": 0, "n": 1, "correct": 1, "errors": 0, "ci_low": 0, "ci_high": 1}
                ],
                "cliff": None,
                "provenance": {},
            }
        )
