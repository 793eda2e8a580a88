"""The investigation on the shipped organism, one planted fault at a time (in-process, CPU).

Reference: fp32 indexer at ``index_topk`` 16 (a deployment top-k the organism handles: recall
1.00 to 4K, docs/organism.md); each candidate is the reference plus exactly one planted fault.
The planted suspect carries the ablation check; the others are absent from the candidate.
Cases: multiturn at 256 and 512 tokens (64 and 128 entries, so top-16 selects), 5 depths x 2
trials (20 cases). One run measures the reference once; later runs copy its records (``_seed_reference``)
because the cases and the reference setting are identical.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from needlescope.investigate.ledger.example import EXAMPLE_FILES, write_example
from needlescope.investigate.run import run_investigation

pytest.importorskip("torch")

REFERENCE = "k=fp32 q=fp32 acc=fp32 topk=16"
SUSPECTS = {
    # id: (ledger mapping line, candidate = reference + this)
    "routed_scaling": ('patch = "patches/routed_scale_twice.py"', {"extra": "patches/routed_scale_twice.py"}),
    "hc_mix_bf16": ('patch = "patches/hc_mix_bf16.py"', {"extra": "patches/hc_mix_bf16.py"}),
    "index_keys_fp4_norot": (
        'setting = "k=fp4_e2m1 hadamard=off"',
        {"setting": "k=fp4_e2m1 hadamard=off topk=16"},
    ),
    "index_topk": ('setting = "topk=8"', {"setting": "k=fp32 topk=8"}),
    "page_table": (
        'patch = "fault:indexer_page_table"',
        {"setting": "k=fp32 topk=16 patch=fault:indexer_page_table"},
    ),
    "key_slot": (
        'patch = "fault:indexer_key_slot"',
        {"setting": "k=fp32 topk=16 patch=fault:indexer_key_slot"},
    ),
}


LENGTHS = {"key_slot": "[512, 1024]"}
"""The key-slot fault costs 1 + 3 of 20 cases at 256 and 512 tokens (p = 0.125, too few
discordant pairs to call), 3 + 6 at 512 and 1,024 (docs/investigate.md): it is planted there."""


def plant_ledger(directory, planted: str) -> str:
    write_example(directory, force=True)
    cand = SUSPECTS[planted][1]
    setting = cand.get("setting", REFERENCE)
    extra = f'["{cand["extra"]}"]' if "extra" in cand else "[]"
    lines = [
        "[target]",
        'model = "organism"',
        # One torch thread: the organism is dispatch-bound (no faster with two alone) and each of
        # `make test`'s two workers has one core; test_interrupt_and_resume's child process then
        # computes with the thread count of the in-process run it is compared with.
        "threads = 1",
        f'reference = "{REFERENCE}"',
        f'candidate = "{setting}"',
        f"extra_patches = {extra}",
        "",
        "[symptom]",
        'kind = "multiturn"',
        f"lengths = {LENGTHS.get(planted, '[256, 512]')}",
        "depths = [0, 25, 50, 75, 100]",
        "trials = 2",
        "max_new_tokens = 6",
        "",
    ]
    for i, (sid, (mapping, _)) in enumerate(SUSPECTS.items()):
        checks = '["ablation"]' if sid == planted else "[]"
        lines += [
            "[[suspects]]",
            f'id = "{sid}"',
            f"tier = {1 + i // 2}",
            f'hypothesis = "{sid} costs recall"',
            mapping,
            f"checks = {checks}",
            "",
        ]
    path = directory / "investigation.toml"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def organism():
    from needlescope.dsa.checkpoint import load_bundle

    model, tokenizer, _ = load_bundle("organism")
    return model, tokenizer


@pytest.fixture(scope="module")
def reference_records(tmp_path_factory):
    return tmp_path_factory.mktemp("ref") / "reference.jsonl"


def _seed_reference(out, cache) -> None:
    """Copy the reference records measured so far (any lengths) into ``out``: the run measures
    only the cases it lacks, and ignores records of cases its ledger does not have."""
    if cache.exists():
        (out / "measure").mkdir(parents=True, exist_ok=True)
        shutil.copy(cache, out / "measure" / "reference.jsonl")


def _run(tmp_path, planted, organism, cache) -> dict:
    ledger = plant_ledger(tmp_path, planted)
    out = tmp_path / "out"
    _seed_reference(out, cache)
    run_investigation(ledger, out, loaded=organism)
    # the cache keeps every length measured so far: the run set aside the records of cases its
    # ledger does not have (measure/reference.jsonl.superseded)
    measured = out / "measure" / "reference.jsonl"
    aside = measured.with_name(measured.name + ".superseded")
    cache.write_text(measured.read_text() + (aside.read_text() if aside.exists() else ""))
    return json.loads((out / "verdicts.json").read_text())


# Measured with these cases (2 CPU cores, docs/investigate.md): routed scaling twice and the
# bf16 hyper-connection GEMM move the logits but not recall; the page-table fault costs 16 of
# 20 cases; the key-slot fault at 512 and 1,024 tokens costs 9 of 20 with none gained; fp4 keys
# without the rotation and top-8 move the logits but leave this organism's recall where it
# was at these lengths (the measured reason is in docs/investigate.md).
EXPECTED = {
    "routed_scaling": "diverges_no_effect",
    "hc_mix_bf16": "diverges_no_effect",
    "page_table": "implicated",
    "key_slot": "implicated",
    "index_keys_fp4_norot": "diverges_no_effect",
    "index_topk": "diverges_no_effect",
}


@pytest.fixture(scope="module")
def page_table_out(tmp_path_factory, organism, reference_records):
    d = tmp_path_factory.mktemp("page_table")
    _run(d, "page_table", organism, reference_records)
    return d / "out"


@pytest.mark.parametrize("planted", list(SUSPECTS))
def test_one_planted_fault(tmp_path, planted, organism, reference_records, request):
    if planted == "page_table":
        v = json.loads((request.getfixturevalue("page_table_out") / "verdicts.json").read_text())
    else:
        v = _run(tmp_path, planted, organism, reference_records)
    by = {s["id"]: s for s in v["suspects"]}
    for sid, s in by.items():
        if sid != planted:
            assert s["verdict"] == "exonerated", (sid, s)
            assert (
                s["reason"].startswith("not present in the candidate (") and "no causal check" in s["reason"]
            )
            presence = [e for e in s["evidence"] if e["check"] == "presence"]
            assert [e["value"] for e in presence] == ["absent"], s
    got = by[planted]
    ev = {e["metric"].split(" (")[0]: e["value"] for e in got["evidence"]}
    assert "exact McNemar p" in ev, got
    assert got["verdict"] == EXPECTED[planted], got
    if got["verdict"] == "implicated":
        assert ev["exact McNemar p"] < 0.05 and ev["discordant b"] >= 6 > ev["discordant c"], got
    if got["verdict"] == "diverges_no_effect":  # both numbers: no recall change, a logit change
        assert ev["discordant b"] == ev["discordant c"] == 0, got
        assert ev["final-logit relative error, " + planted + " added alone to the reference"] > 1e-5, got
    if got["verdict"] == "implicated":
        assert v["root_cause"] == planted
    else:
        assert v["root_cause"] is None
    sig = v["signature"]
    if planted == "page_table":
        # The scrambled page table leaves the needle's rank near chance at the first answer
        # token; every tested length (256, 512) lies beyond both capacities (64, 128 tokens), so
        # the collapse cannot be shown to track top-k and the rule does not fire.
        assert sig["ranking"] == "uninformative", sig["layers"]
        assert sig["collapse"]["tracks"] is not True, sig["collapse"]
    elif planted in ("routed_scaling", "hc_mix_bf16"):
        assert sig["ranking"] == "informative", sig["layers"]
    assert sig["uninformative_ranking"] is False, sig


def _as_if_typed_at_a_terminal() -> None:
    """In the child: SIGINT back to its default, and a lower priority. A test run started in the
    background (``make test &`` in a script) ignores SIGINT, every descendant inherits that, and
    Python then never raises KeyboardInterrupt: the run went on to the end (2026-12-06)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.nice(10)


def _interrupted_run(cmd: list[str], cand: Path) -> tuple[list[str], int, str]:
    """Start ``cmd`` (niced, so that this process sees the first records before the next batch
    lands, even on a loaded box), SIGINT it once ``cand`` holds records; the case ids then, the
    exit code and stderr."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_if_typed_at_a_terminal,
    )
    deadline = time.time() + 600
    while time.time() < deadline and (not cand.exists() or not cand.read_text().strip()):
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    return [json.loads(x)["case_id"] for x in cand.read_text().splitlines()], proc.returncode, stderr


def test_interrupt_and_resume(tmp_path, reference_records, page_table_out, run_cli_completed):
    """A real ``needlescope investigate run`` interrupted (Ctrl-C) mid-measurement says what it
    saved and how to go on, exits 130, and resumes without losing or repeating a case, to the
    verdicts of an uninterrupted run (``page_table_out``: the same ledger, in-process). The
    resuming command runs through the same entry point in this process (a child spent seconds
    importing torch first)."""
    ledger = plant_ledger(tmp_path, "page_table")
    out = tmp_path / "out"
    _seed_reference(out, reference_records)
    cmd = [sys.executable, "-m", "needlescope.cli.main", "investigate", "run", str(ledger), "--out", str(out)]
    cand = out / "measure" / "candidate.jsonl"
    before, code, stderr = _interrupted_run(cmd, cand)
    assert 1 <= len(before) < 20, "the run was not interrupted mid-measurement"
    assert code == 130 and "Traceback" not in stderr, stderr[-2000:]
    saved = sum(1 for f in (out / "measure").glob("*.jsonl") for x in f.read_text().splitlines() if x.strip())
    again = "rerun the same command to continue (finished steps and cases are kept)"
    assert f"interrupted: {saved} measured cases saved in {out / 'measure'}; {again}" in stderr, stderr
    state = json.loads((out / "state.json").read_text())
    assert state["done"]["questions"] is True
    done = run_cli_completed(*cmd[3:])
    assert done.returncode == 0, done.stderr[-2000:]
    after = [json.loads(x)["case_id"] for x in cand.read_text().splitlines()]
    assert after[: len(before)] == before and len(after) == len(set(after)) == 20
    v = json.loads((out / "verdicts.json").read_text())
    assert v["root_cause"] == "page_table"
    whole = json.loads((page_table_out / "verdicts.json").read_text())
    assert [(s["id"], s["verdict"], s["evidence"]) for s in v["suspects"]] == [
        (s["id"], s["verdict"], s["evidence"]) for s in whole["suspects"]
    ]
    diagnosis = (out / "DIAGNOSIS.md").read_text()
    assert diagnosis.count("page_table") >= 2
    assert f"Command: `needlescope investigate run {ledger} --out {out}`" in diagnosis  # the footer


def test_example_files_are_complete():
    assert set(EXAMPLE_FILES) >= {"investigation.toml", "deployment.env", "patches/hc_mix_bf16.py"}


def test_batched_measurement_equals_one_at_a_time(organism):
    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.prompt import render_prompt
    from needlescope.investigate.ledger.plan import Config
    from needlescope.investigate.measure.records import measure_case, measure_cases
    from needlescope.setting import Setting

    model, tok = organism
    spec = CaseSpec(kind="multiturn", lengths=(256,), depths=(0.0, 100.0), trials=1, seed=3, value_digits=3)
    cases = build_cases(spec, lambda m: len(render_prompt(tok, m).input_ids))
    cfg = Config(Setting.parse("k=fp8_e4m3 topk=16 patch=fault:indexer_page_table"))
    one = [measure_case(model, tok, c, cfg, max_new_tokens=6) for c in cases]
    assert measure_cases(model, tok, cases, cfg, max_new_tokens=6) == one
    assert all(r["layers"] and r["analysed_source"] for r in one)
