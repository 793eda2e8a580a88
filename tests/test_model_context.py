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


def test_serve_probe_explain_refuses_a_length_beyond_the_context(run_cli, tmp_path):
    line = _one_line(*run_cli("serve-probe-explain", "--lengths", "256,9000", "--out", str(tmp_path / "d")))
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


def test_rank_dump_refuses_a_prompt_beyond_the_context_before_loading(run_cli, tmp_path, monkeypatch):
    """The prompt is tokenized inside the workflow: its length, with the greedy answer, is checked
    there against the checkpoint's context, before any model loads."""
    import json

    from needlescope.dsa import checkpoint

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded for a prompt beyond its context")

    monkeypatch.setattr(checkpoint, "load_bundle", no_load)
    chat = json.loads(open("examples/chat.json").read())
    needle = "The secret code of the teal salmon is 179."
    long = tmp_path / "long.json"
    long.write_text(json.dumps([chat[0], {**chat[1], "content": chat[1]["content"] * 40}, chat[2]]))
    line = _one_line(
        *run_cli("indexer", "rank-dump", "--model", "organism", "--prompt", str(long), "--needle", needle,
                 "--out", str(tmp_path / "r"))
    )  # fmt: skip
    tokens = int(line.split("the prompt is ", 1)[1].split()[0])
    assert tokens > 8192 - 12, line
    assert f"{long}: the prompt is {tokens} tokens and its answer up to 12 more; {CONTEXT[:-1]}" in line
    assert "shorten the prompt to at most 8180 tokens" in line
    # Explicit query positions run one prefill: no answer tokens are added to the prompt.
    line = _one_line(
        *run_cli("indexer", "rank-dump", "--model", "organism", "--prompt", str(long), "--needle", needle,
                 "--positions", "5", "--out", str(tmp_path / "r"))
    )  # fmt: skip
    assert f"the prompt is {tokens} tokens; the model's context" in line and "at most 8192 tokens" in line
    assert not (tmp_path / "r").exists()
