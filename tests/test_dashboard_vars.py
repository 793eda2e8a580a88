"""The Grafana dashboard selects one canary (issue 29, item 11): ``job`` and ``instance``
variables, and every needlescope series filtered by them, so two canaries never mix; the
engine's job is a variable too, not a hard-coded ``job="engine"``."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/needlescope.json"


def test_every_series_is_filtered_by_job_and_instance():
    dash = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance", "engine_job"} <= names
    exprs = [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    selectors = [m for e in exprs for m in re.finditer(r"\b(needlescope_[a-z_]+)(\{[^}]*\})?", e)]
    assert selectors
    for m in selectors:
        labels = m.group(2) or ""
        assert 'job=~"$job"' in labels and 'instance=~"$instance"' in labels, m.group(0)
    assert not any(re.search(r'job="[^$]', e) for e in exprs), exprs
    by_name = {v["name"]: v for v in dash["templating"]["list"]}
    assert "$job" in by_name["instance"]["definition"]
