"""First contact as an outsider meets it: `make demo`'s first step, `organism train` and the
output-folder messages, through the real CLI entry point (``run_cli``: exit codes and error lines
as on the shell). Each test is a bug found by trying the commands as a new user would."""

from __future__ import annotations

import json

import pytest

from needlescope.cli.outputs import OUTPUT_SPECS
from needlescope.outdir import MANIFEST_NAME, record_outputs

MINE = b'{"my": "own config"}\n'
# A checkpoint in seconds: the organism's architecture, untrained (no step of any phase).
NO_STEPS = ["--device", "cpu", "--steps-dense", "0", "--steps-distil", "0", "--workers", "0"]


def one_error_line(code: int, stdout: str, stderr: str) -> str:
    assert code == 2, stdout + stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_make_demos_first_step_into_a_file_is_one_line(run_cli, tmp_path):
    """`make demo` runs `investigate init demo-out` first: with a file named demo-out (or under a
    file) it died in a FileExistsError / NotADirectoryError traceback."""
    demo_out = tmp_path / "demo-out"
    demo_out.write_text("a file, not a folder\n")
    line = one_error_line(*run_cli("investigate", "init", str(demo_out)))
    assert f"{demo_out} is a file, not a folder" in line
    line = one_error_line(*run_cli("investigate", "init", str(demo_out / "sub")))
    assert f"{demo_out} is a file, so the folder cannot be made" in line
    assert demo_out.read_text() == "a file, not a folder\n"


def test_organism_train_never_overwrites_a_checkpoint_it_did_not_write(run_cli, tmp_path):
    """`organism train --out DIR` wrote its config.json, weights and tokenizer over whatever DIR
    held (README: every command that writes a folder refuses a file it did not write)."""
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_bytes(MINE)
    (out / "notes.txt").write_bytes(MINE)
    line = one_error_line(*run_cli("organism", "train", "--out", str(out), *NO_STEPS))
    assert "config.json was not written by needlescope" in line and "--force" in line
    assert (out / "config.json").read_bytes() == MINE and not (out / "model.safetensors").exists()

    (out / "config.json").unlink()
    # docs/organism.md's recipe as two commands (stage 1 into OUT/stage1, stage 2 from it into
    # OUT), then stage 2 again: what it wrote itself it may write again.
    stage1 = ["--out", str(out / "stage1"), *NO_STEPS]
    stage2 = ["--out", str(out), "--init-from", str(out / "stage1"), *NO_STEPS]
    for argv in (stage1, stage2, stage2):
        code, stdout, stderr = run_cli("organism", "train", *argv)
        assert code == 0, stdout + stderr
    recorded = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert {"config.json", "model.safetensors", "training.json"} <= set(recorded)
    assert (out / "notes.txt").read_bytes() == MINE and "notes.txt" not in recorded


def test_organism_train_refuses_a_file_at_out_before_training(run_cli, tmp_path):
    """A file at --out was found only by save_pretrained, after the whole training."""
    out = tmp_path / "ckpt"
    out.write_bytes(MINE)
    line = one_error_line(*run_cli("organism", "train", "--out", str(out), *NO_STEPS))
    assert f"--out {out} is a file, not a folder" in line
    assert out.read_bytes() == MINE


def test_organism_train_init_from_a_missing_checkpoint_is_one_line(run_cli, tmp_path):
    """transformers took the missing path for a Hub repo id: an OSError traceback."""
    missing = tmp_path / "no-such-checkpoint"
    line = one_error_line(
        *run_cli("organism", "train", "--out", str(tmp_path / "o"), "--init-from", str(missing), *NO_STEPS)
    )
    assert line.startswith("error: --init-from: ") and str(missing) in line
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    line = one_error_line(
        *run_cli(
            "organism", "train", "--out", str(tmp_path / "o"), "--init-from", str(not_a_checkpoint), *NO_STEPS
        )
    )
    assert "--init-from" in line and "config.json" in line
    assert not (tmp_path / "o").exists()


def test_organism_train_refuses_a_config_override_that_names_no_field(run_cli, tmp_path):
    """The config keeps any keyword as an attribute: hiden_size=32 trained the full-size model."""
    out = tmp_path / "o"
    line = one_error_line(
        *run_cli("organism", "train", "--out", str(out), "--config-override", "hiden_size=32", *NO_STEPS)
    )
    assert "hiden_size is not an integer field of the organism's config; did you mean hidden_size?" in line
    line = one_error_line(
        *run_cli("organism", "train", "--out", str(out), "--config-override", "vocab_size=32", *NO_STEPS)
    )
    assert "vocab_size is set from the tokenizer" in line  # was a TypeError traceback
    assert not out.exists()


def test_a_file_a_compare_wrote_is_not_called_foreign_in_its_side_folder(run_cli, tmp_path):
    """`probe --out runs/ab/a` (a compare's side, recorded in runs/ab's manifest) said "heatmap.png
    was not written by needlescope": untrue, and sent the user looking for who wrote it."""
    ab = tmp_path / "ab"
    (ab / "a").mkdir(parents=True)
    (ab / "a" / "heatmap.png").write_bytes(b"\x89PNG side A's heatmap")
    record_outputs(ab, OUTPUT_SPECS["compare"])  # what compare records when its run ends
    line = one_error_line(
        *run_cli("probe", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--out", str(ab / "a"))
    )
    assert f"heatmap.png was written by needlescope compare into {ab}, not probe here" in line


def test_serve_probe_explain_refuses_a_length_given_twice_before_it_serves_or_writes(run_cli, tmp_path):
    """`needlescope serve-probe-explain --lengths 256,256`: refused only by the first probe, once both servers
    were up and --out was made with its manifest; the command promises every input is checked
    before the filesystem is touched."""
    out = tmp_path / "spe"
    line = one_error_line(
        *run_cli("serve-probe-explain", "--out", str(out), "--lengths", "256,256", "--trials", "1")
    )
    assert "--lengths 256,256 names a length twice" in line
    assert not out.exists()


@pytest.mark.parametrize(
    "argv", [["-h"], ["probe", "-h"], ["investigate", "run", "-h"], ["indexer", "diff", "-h"]]
)
def test_dash_h_is_help_like_dash_dash_help(run_cli, argv):
    """``needlescope -h`` was 'No such option: -h' (exit 2): the first thing many users type."""
    code, stdout, stderr = run_cli(*argv)
    assert code == 0 and stdout.startswith("Usage: ") and "Options:" in stdout, stdout + stderr
