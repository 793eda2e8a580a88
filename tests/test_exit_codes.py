"""Issue 54, item 16: one exit-code convention for every judge (docs/exit_codes.md).

Each judge is run on clean input (0), on input holding what it looks for (1) and on malformed
input (2, one line); ``indexer compare-dump`` exited 0 on a tensor beyond its budget. Every
command of the CLI must be classified in docs/exit_codes.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import typer

torch = pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[1] / "docs" / "exit_codes.md"


def _commands(group, prefix: str = "") -> list[str]:
    out = []
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group (typer's own click types)
            out += _commands(cmd, f"{prefix}{name} ")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_every_command_is_in_the_exit_code_table():
    from needlescope.cli.main import app

    documented = set(re.findall(r"`([a-z][a-z -]*[a-z])`", DOC.read_text()))
    commands = _commands(typer.main.get_command(app))
    assert len(commands) > 20
    assert [c for c in commands if c not in documented] == []


def _one_line(code: int, err: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)


def _capture(path: Path, indices) -> Path:
    from safetensors.torch import save_file

    logits = torch.tensor([[5.0, 3.0, 3.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    save_file({"logits": logits, "indices": torch.tensor(indices, dtype=torch.int32)}, str(path))
    return path


def test_topk_audit(run_cli, tmp_path):
    good = _capture(tmp_path / "good.safetensors", [[0, 2], [3, 2]])
    bad = _capture(tmp_path / "bad.safetensors", [[0, 2], [3, 0]])
    assert run_cli("indexer", "topk-audit", str(good), "--out", str(tmp_path / "a"))[0] == 0
    assert run_cli("indexer", "topk-audit", str(bad), "--out", str(tmp_path / "b"))[0] == 1
    code, _, err = run_cli(
        "indexer", "topk-audit", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "c")
    )
    _one_line(code, err)


def test_kernels_conform(run_cli, tmp_path):
    (tmp_path / "empty.py").write_text(
        "import torch\ndef topk(scores, k, lengths):\n    return torch.full((scores.shape[0], k), -1)\n"
    )
    case = ["--case", "nan"]
    assert run_cli("kernels", "conform", "--impl", "torch", *case)[0] == 0
    assert run_cli("kernels", "conform", "--impl", f"{tmp_path / 'empty.py'}:topk", *case)[0] == 1
    code, _, err = run_cli("kernels", "conform", "--impl", "no_such_module_xyz:topk", *case)
    _one_line(code, err)


def test_compare_dump(run_cli, tmp_path):
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.dump_mapping import load_mapping
    from needlescope.testing.sglang_dump import write_sglang_dump

    model = load_bundle("organism", device="cpu")[0]
    ids = np.random.default_rng(0).integers(10, 3000, 10).tolist()
    clean = write_sglang_dump(
        model, ids, tmp_path / "clean", mapping=load_mapping(), passes=[10], index_topk=8
    )
    handle = model.get_submodule("model.layers.3.self_attn.o_b_proj").register_forward_hook(
        lambda m, i, o: o * 1.25
    )
    try:
        faulty = write_sglang_dump(
            model, ids, tmp_path / "faulty", mapping=load_mapping(), passes=[10], index_topk=8
        )
    finally:
        handle.remove()
    args = ["--model", "organism"]
    assert run_cli("indexer", "compare-dump", str(clean), *args, "--out", str(tmp_path / "a"))[0] == 0
    assert run_cli("indexer", "compare-dump", str(faulty), *args, "--out", str(tmp_path / "b"))[0] == 1
    code, _, err = run_cli(
        "indexer", "compare-dump", str(tmp_path / "none"), *args, "--out", str(tmp_path / "c")
    )
    _one_line(code, err)
