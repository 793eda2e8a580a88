"""Issue 38, items 5 and 6: no command overwrites a file it did not write. Every command that
takes --out is run against a folder holding a foreign file at a name it writes: it refuses in one
line naming the file (exit 2), and the file survives byte for byte; --force is the only way past.
"""

from __future__ import annotations

import json

import pytest

from needlescope.errors import BadInput
from needlescope.outdir import MANIFEST_NAME, OutputSpec, check_outputs, record_outputs

DEAD = "http://127.0.0.1:9/v1"
FOREIGN = b"my own notes \x00\xff, not needlescope's\n"
PROMPT = ["--prompt", "examples/chat.json", "--needle", "The secret code of the teal salmon is 179."]

# (command line with OUT for the folder, the file planted there)
COMMANDS = [
    (["probe", "--base-url", DEAD, "--model", "m", "--lengths", "256", "--out", "OUT"], "report.md"),
    (
        ["probe", "--bisect", "--base-url", DEAD, "--model", "m", "--lengths", "256,512", "--out", "OUT"],
        "bisect.md",
    ),
    (["compare", "--a", DEAD, "--b", DEAD, "--model", "m", "--lengths", "256", "--out", "OUT"], "report.md"),
    (["compare", "--a-run", "OUT/x", "--b-run", "OUT/y", "--out", "OUT"], "compare.json"),
    (["engine-state", "--base-url", DEAD, "--model", "m", "--out", "OUT"], "engine_state.md"),
    (["serving-factors", "--base-url", DEAD, "--model", "m", "--out", "OUT"], "serving_factors.md"),
    (["oracle", "export", "--base-url", DEAD, "--out", "OUT"], "export.json"),
    (["oracle", "compare", "OUT/ref", "--base-url", DEAD, "--out", "OUT"], "oracle.md"),
    (["indexer", "rank-dump", "--model", "organism", *PROMPT, "--out", "OUT"], "rankdump.md"),
    (["indexer", "sweep", "--model", "organism", "--index-topk", "64", "--out", "OUT"], "sweep.md"),
    (["indexer", "synthetic", "--entries", "64", "--topk", "8", "--out", "OUT"], "synthetic.md"),
    (["indexer", "diff", "--model", "organism", "--index-k", "fp8_e4m3", *PROMPT, "--out", "OUT"], "diff.md"),
    (["indexer", "capture", "--sglang", DEAD, *PROMPT, "--out", "OUT"], "capture.md"),
    (["indexer", "compare-dump", "OUT/dump", "--model", "organism", "--out", "OUT"], "compare_dump.md"),
    (["indexer", "topk-audit", "OUT/capture.pt", "--out", "OUT"], "topk_audit.json"),
    (["kernels", "conform", "--impl", "torch", "--out", "OUT/conform.json"], "conform.json"),
    (["audit", "--checks", "routed_scale", "--out", "OUT/audit.json"], "audit.json"),
    (["serve-probe-explain", "--out", "OUT"], "DIAGNOSIS.md"),
    (["investigate", "init", "OUT"], "investigation.toml"),
    (["investigate", "run", "OUT/ledger.toml", "--out", "OUT"], "DIAGNOSIS.md"),
]


@pytest.mark.parametrize("argv, planted", COMMANDS, ids=[" ".join(c[:2]) for c, _ in COMMANDS])
def test_every_out_command_refuses_to_overwrite_a_foreign_file(run_cli, tmp_path, argv, planted):
    out = tmp_path / "out"
    out.mkdir()
    (out / planted).write_bytes(FOREIGN)
    (out / "notes.txt").write_bytes(FOREIGN)
    code, stdout, stderr = run_cli(*[a.replace("OUT", str(out)) for a in argv])
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and planted in lines[0], stderr
    assert "Traceback" not in stderr
    assert (out / planted).read_bytes() == FOREIGN and (out / "notes.txt").read_bytes() == FOREIGN


def test_force_is_the_way_past(run_cli, tmp_path):
    out = tmp_path / "ledger"
    out.mkdir()
    (out / "investigation.toml").write_bytes(FOREIGN)
    assert run_cli("investigate", "init", str(out))[0] == 2
    code, stdout, stderr = run_cli("investigate", "init", str(out), "--force")
    assert code == 0, stderr
    assert (out / "investigation.toml").read_bytes() != FOREIGN
    recorded = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert recorded["investigation.toml"]["command"] == "investigate init"
    assert f"--out {out}\n" in stdout  # the run beside its ledger, as make demo runs it (issue 54 item 17)


def test_serve_probe_explain_force_is_the_way_past_and_keeps_other_files(run_cli, tmp_path):
    from needlescope.dsa.checkpoint import resolve_model_dir
    from needlescope.workflows.serve_probe_explain import check_out, prepare_out

    out = tmp_path / "spe"
    out.mkdir()
    (out / "DIAGNOSIS.md").write_bytes(FOREIGN)
    (out / "notes.txt").write_bytes(FOREIGN)
    # A device no machine has is refused before --out is touched, --force or not (it was found
    # only when the first server started, after the folder had been cleared).
    code, stdout, stderr = run_cli("serve-probe-explain", "--out", str(out), "--device", "cuda:99", "--force")
    assert code == 2 and "--device cuda:99" in stderr and "DIAGNOSIS.md" not in stderr, stdout + stderr
    assert (out / "DIAGNOSIS.md").read_bytes() == FOREIGN
    # --force is the way past: the pipeline's names are cleared, any other file kept.
    check_out(out, resolve_model_dir("organism"), force=True)
    prepare_out(out)
    assert not (out / "DIAGNOSIS.md").exists() and (out / "notes.txt").read_bytes() == FOREIGN


SPEC = OutputSpec("probe", ("report.md", "bundles/", "results.sqlite"), state=("results.sqlite",))


def test_what_the_command_wrote_it_may_rewrite_and_nothing_else(tmp_path):
    (tmp_path / "bundles").mkdir()
    (tmp_path / "report.md").write_text("ours")
    (tmp_path / "bundles" / "case.json").write_text("{}")
    record_outputs(tmp_path, SPEC)
    check_outputs(tmp_path, SPEC)  # all ours, unchanged

    (tmp_path / "results.sqlite").write_text("a store: the probe checks it itself")
    (tmp_path / "ledger.toml").write_text("not a name the probe writes")
    check_outputs(tmp_path, SPEC)

    (tmp_path / "bundles" / "case.json").write_text('{"edited": true}')
    with pytest.raises(BadInput, match=r"bundles/case.json was changed after needlescope probe wrote it"):
        check_outputs(tmp_path, SPEC)
    check_outputs(tmp_path, SPEC, force=True)
    record_outputs(tmp_path, SPEC)

    with pytest.raises(BadInput, match=r"report.md was written by needlescope probe, not compare"):
        check_outputs(tmp_path, OutputSpec("compare", ("report.md",)))


def test_make_demo_deletes_nothing_and_keeps_an_edited_ledger():
    """Item 5: the demo's recipe runs no rm, and writes the example ledger only when it is missing."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = text.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "rm " not in recipe
    init = next(line for line in recipe.splitlines() if "investigate init" in line)
    assert init.strip().startswith("test -f demo-out/investigation.toml ||")
