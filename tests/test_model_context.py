"""Issue 38, item 10 and R12: the in-process tools refuse lengths beyond the checkpoint's context,
and an index_topk no context holds, in one line (exit 2) before any model loads."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def _one_line(code: int, out: str, err: str) -> str:
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


CONTEXT = "the model's context is 8192 tokens (organism's config.json max_position_embeddings)"


def test_sweep_refuses_a_length_beyond_the_context(run_cli, tmp_path):
    line = _one_line(
        *run_cli("indexer", "sweep", "--model", "organism", "--lengths", "512,9000", "--index-topk", "64",
                 "--out", str(tmp_path / "s"))
    )  # fmt: skip
    assert f"--lengths 9000: {CONTEXT}" in line and "pass lengths up to" in line
    assert not (tmp_path / "s").exists()


def test_sweep_and_rank_dump_refuse_an_unbounded_topk(run_cli, tmp_path):
    line = _one_line(
        *run_cli("indexer", "sweep", "--model", "organism", "--lengths", "512", "--index-topk", "10000000000000",
                 "--out", str(tmp_path / "s"))
    )  # fmt: skip
    assert "--index-topk 10000000000000: more entries than the model's context of 8192 tokens" in line
    line = _one_line(
        *run_cli("indexer", "rank-dump", "--model", "organism", "--prompt", "examples/chat.json", "--needle",
                 "The secret code of the teal salmon is 179.", "--index-topk", "999999", "--out", str(tmp_path / "r"))
    )  # fmt: skip
    assert "--index-topk 999999: more entries" in line


def test_demo_refuses_a_length_beyond_the_context(run_cli, tmp_path):
    line = _one_line(*run_cli("demo", "--lengths", "256,9000", "--out", str(tmp_path / "d")))
    assert f"--lengths 9000: {CONTEXT}" in line
    assert not (tmp_path / "d").exists()


def test_a_ledger_beyond_the_context_or_with_an_unbounded_topk_is_refused(run_cli, tmp_path):
    assert run_cli("investigate", "init", str(tmp_path / "inv"))[0] == 0
    ledger = tmp_path / "inv" / "investigation.toml"
    text = ledger.read_text()
    ledger.write_text(text.replace("lengths = [256, 512, 1024]", "lengths = [256, 9000]"))
    line = _one_line(*run_cli("investigate", "run", str(ledger), "--out", str(tmp_path / "out")))
    assert f"[symptom] lengths 9000: {CONTEXT}" in line
    ledger.write_text(text.replace("topk=64 patch", "topk=100000000000 patch"))
    line = _one_line(*run_cli("investigate", "run", str(ledger), "--out", str(tmp_path / "out")))
    assert "index_topk 100000000000: more entries than the model's context of 8192 tokens" in line
    assert not (tmp_path / "out").exists()
