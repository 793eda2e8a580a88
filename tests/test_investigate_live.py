"""The live-endpoint route against a real ``needlescope serve`` child: the "live deployment" is
the organism served with fp32 keys, ``index_topk`` 16 and ``fault:indexer_page_table`` planted;
the ledger knows only its URL and the reference checkpoint. The matching suspect's emulation
reproduces the live selection failure (implicated); the others' do not."""

from __future__ import annotations

import json

import pytest

from live_ledgers import live_suspect, write_live_ledger
from needlescope.investigate.run import run_investigation

pytest.importorskip("torch")

LIVE = "k=fp32 topk=16 patch=fault:indexer_page_table"
SUSPECTS = {
    "page_table": 'patch = "fault:indexer_page_table"',
    "key_slot": 'patch = "fault:indexer_key_slot"',
    "index_keys_fp8": 'setting = "k=fp8_e4m3"',
    "index_topk": 'setting = "topk=16"',
}


def live_ledger(directory, url: str, *, checks: str = '["live_emulation"]') -> str:
    suspects = [
        live_suspect(sid, sid, mapping, tier=1 + i // 2, checks=checks)
        for i, (sid, mapping) in enumerate(SUSPECTS.items())
    ]
    return write_live_ledger(
        directory, url, lengths="[512]", depths="[0, 25, 50, 75, 100]", trials=2, max_new_tokens=6,
        suspects=suspects,
    )  # fmt: skip


@pytest.fixture(scope="module")
def live_server():
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    cfg = ServeConfig(model="organism", port=0, setting=Setting.parse(LIVE), threads=1)
    with ServerProcess(cfg, timeout=300) as server:
        yield server


@pytest.fixture(scope="module")
def organism():
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle("organism")[:2]


def test_live_emulation_implicates_the_planted_fault(tmp_path, live_server, organism):
    out = tmp_path / "out"
    run_investigation(live_ledger(tmp_path, live_server.url), out, loaded=organism)
    v = json.loads((out / "verdicts.json").read_text())
    by = {s["id"]: s for s in v["suspects"]}
    assert by["page_table"]["verdict"] == "implicated", by["page_table"]
    assert v["root_cause"] == "page_table"
    # /get_server_info against the reference: the top-k and the patch differ, both named by suspects
    diffs = {d["name"]: d for d in v["differences"]}
    assert set(diffs) == {"index_topk", "patch"} and v["unaccounted_differences"] == [], v["differences"]
    assert diffs["index_topk"]["candidate"] == "16" and diffs["index_topk"]["covered_by"] == ["index_topk"]
    for sid in ("key_slot", "index_keys_fp8", "index_topk"):
        assert by[sid]["verdict"] != "implicated", by[sid]
    ev = {e["metric"]: e["value"] for e in by["page_table"]["evidence"]}
    assert ev["Jaccard emulation vs live (mean over rows)"] > ev["Jaccard baseline vs live (mean over rows)"]
    assert v["symptom"]["failing_cases"] >= 3 and v["symptom"]["errors"] == 0
    inv = json.loads((out / "investigation.json").read_text())
    assert inv["route"] == "live" and inv["candidate_topk"] == 16
    # Every live record keeps the rows it was compared on; the run resumes without re-probing.
    live = [json.loads(x) for x in (out / "measure" / "live.jsonl").read_text().splitlines()]
    assert len(live) == 10 and all(r["rows"] for r in live)
    # A failed request is an error record, not a miss; the next run sends that case again, and
    # suspects measured while that case was missing (as a run whose request failed measured them)
    # are measured again: the rerun decides from all the data, as the uninterrupted run did.
    path = out / "measure" / "live.jsonl"
    path.write_text(
        path.read_text() + json.dumps({"case_id": live[0]["case_id"], "error": "TransportFailure: x"}) + "\n"
    )
    state = json.loads((out / "state.json").read_text())
    for step in [k for k in state["done"] if k.startswith("measured:")]:
        state["done"][step] = {**state["done"][step], "basis": "fewer cases", "cmps": None, "asked": False}
    (out / "state.json").write_text(json.dumps(state))
    findings = run_investigation(live_ledger(tmp_path, live_server.url), out, loaded=organism)
    again = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(again) == 12 and again[-1]["case_id"] == live[0]["case_id"] and "error" not in again[-1]
    assert again[-1]["answer"] == live[0]["answer"]
    assert findings.verdicts == v  # the same verdicts, reasons and evidence (none doubled)
    from needlescope.investigate.report.diagnosis import write_reports

    md = write_reports(findings)[0].read_text()
    assert "## Live selection vs each suspect's emulation" in md and "**page_table**" in md


def test_live_route_refuses_ablation_and_stops_on_a_dead_endpoint(tmp_path, organism):
    from needlescope.errors import BadInput
    from needlescope.investigate.ledger.ledger import load_ledger

    bad = live_ledger(tmp_path, "http://127.0.0.1:9", checks='["ablation"]')
    with pytest.raises(BadInput, match="cannot be ablated"):
        load_ledger(bad)
    out = tmp_path / "dead"
    ledger = live_ledger(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(BadInput, match="answered no case .live endpoint unavailable") as exc:
        run_investigation(ledger, out, loaded=organism)
    assert "nothing was decided" in str(exc.value) and not (out / "verdicts.json").exists()
