"""Ledgers and bundles are checked like probe flags (issue 29, item 9): ranges, unknown keys with
a suggestion, paths confined to the ledger's folder unless ``--allow-outside``; a replay bundle
without an expected answer is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from needlescope.errors import BadInput
from needlescope.investigate.ledger.example import write_example
from needlescope.investigate.ledger.ledger import load_ledger
from needlescope.report.bundle import read_bundle


@pytest.fixture
def ledger(tmp_path):
    return write_example(tmp_path / "inv")


def _with(path, old: str, new: str):
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        ("trials = ", "trials = -3 #", "trials = -3; expected 1..1000"),
        ("trials = ", "trials = 10000000 #", "expected 1..1000"),
        ("lengths = [", "lengths = [99999999, ", "lengths = 99999999; expected 1..1048576"),
        ("trials = ", "trails = 2\ntrials = ", "unknown key 'trails' in [symptom] (did you mean 'trials'?)"),
        ('device = "cpu"', 'devce = "cpu"', "unknown key 'devce' in [target] (did you mean 'device'?)"),
        ('patch = "patches/hc_mix_bf16.py"', 'patch = "../../evil.py"', "outside the ledger's folder"),
        ('env_file = "deployment.env"', 'env_file = "/etc/passwd"', "outside the ledger's folder"),
        (
            'path = "patches/routed_scale_twice.py"',
            'path = "/usr/lib/**/*.py"',
            "outside the ledger's folder",
        ),
        ('type = "source"', 'type = "source"\npaht = "x"', "unknown key 'paht' in a source question"),
        ("tier = 1", "tier = 0", "tier = 0; expected 1..99"),
    ],
)
def test_bad_ledger_values_are_one_line(ledger, old, new, words):
    with pytest.raises(BadInput) as info:
        load_ledger(_with(ledger, old, new))
    message = str(info.value)
    assert words in message and str(ledger) in message and "\n" not in message, message


def test_allow_outside_accepts_a_patch_elsewhere(tmp_path, ledger):
    outside = tmp_path / "elsewhere.py"
    outside.write_text("def apply(model):\n    return None\n")
    _with(ledger, 'patch = "patches/hc_mix_bf16.py"', f'patch = "{outside}"')
    with pytest.raises(BadInput, match="--allow-outside"):
        load_ledger(ledger)
    loaded = load_ledger(ledger, allow_outside=True)
    assert any(s.patch is not None and s.patch.path == outside for s in loaded.suspects)


def test_cli_refuses_an_outside_patch_in_one_line(tmp_path, ledger, run_cli_completed):
    _with(ledger, 'patch = "patches/hc_mix_bf16.py"', 'patch = "../../evil.py"')
    res = run_cli_completed("investigate", "run", str(ledger), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "--allow-outside" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("expected", [[], [""]])
def test_bundle_without_an_expected_answer_is_refused(tmp_path, expected):
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "request.json").write_text(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    )
    manifest = {
        "needlescope_version": "0",
        "created": 0,
        "case_id": "c",
        "expected": expected,
        "failure": None,
        "base_url": None,
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match="expected"):
        read_bundle(bundle)


# ---- a patch that calls sys.exit (issue 29, item 8) ------------------------------------------------


def test_a_patch_calling_sys_exit_is_the_patchs_failure(tmp_path):
    import torch

    from needlescope.dsa.emulate import apply_patch_once, load_patch

    at_import = tmp_path / "exits_at_import.py"
    at_import.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(BadInput, match=r"failed to import: it called sys.exit\(3\)"):
        load_patch(str(at_import))
    in_apply = tmp_path / "exits_in_apply.py"
    in_apply.write_text("import sys\n\ndef apply(model):\n    sys.exit(4)\n")
    with pytest.raises(BadInput, match=r"apply\(model\) failed: it called sys.exit\(4\)"):
        apply_patch_once(torch.nn.Linear(1, 1), str(in_apply))


def test_serve_with_an_exiting_patch_says_so_and_exits_2(tmp_path):
    from needlescope.testing.checkpoints import save_random

    ckpt = save_random(tmp_path / "ckpt", seed=3, hidden_size=64, q_lora_rank=32, o_lora_rank=32,
                       moe_intermediate_size=64, index_topk=8, max_position_embeddings=512)  # fmt: skip
    patch = tmp_path / "exits.py"
    patch.write_text("import sys\n\ndef apply(model):\n    sys.exit(7)\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "needlescope.cli.main",
            "serve",
            "--model",
            str(ckpt),
            "--port",
            "0",
            "--patch",
            str(patch),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    assert "sys.exit(7)" in res.stderr and "Traceback" not in res.stderr, res.stderr[-1500:]
