"""The probe against servers that differ from its own: keys, odd /v1/models, no /tokenize, small
admission queues, an advertised trained value length. Real CLI, real loopback HTTP (scripted server)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from needlescope.report.probe import validate_summary
from test_probe_cli import run_probe

SMALL = ["--lengths", "200,400", "--depths", "0,100", "--trials", "1"]


@pytest.fixture
def probe(run_cli_completed):
    """The probe CLI in this process, as in tests/test_probe_cli.py."""
    return functools.partial(run_probe, run_cli_completed)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_the_api_key_reaches_tokenize_and_provenance_and_is_never_written(scripted_server, tmp_path, probe):
    key = "sk-needlescope-test-7d1f"
    url = scripted_server(api_key=key, trained_value_digits=3)
    res = probe(url, tmp_path, *SMALL, "--api-key", key)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    # /get_server_info answered (it needs the key): provenance holds it and its trained value length.
    assert summary["provenance"]["status"]["/get_server_info"] == 200
    assert all(r["counted_length"] == r["length"] == r["prompt_tokens"] for r in rows(tmp_path))
    for f in tmp_path.iterdir():
        assert key.encode() not in f.read_bytes(), f.name
    without = probe(url, tmp_path / "nokey", *SMALL)
    assert without.returncode == 2 and "--api-key" in without.stderr


@pytest.mark.parametrize("models", ["empty", "error"])
def test_a_server_whose_model_list_is_empty_or_fails_is_probed_after_a_test_chat(
    scripted_server, tmp_path, models, probe
):
    url = scripted_server(models=models)
    res = probe(url, tmp_path, *SMALL)
    assert res.returncode == 0, res.stderr
    assert "assumed to be served" in (tmp_path / "report.md").read_text()


def test_a_small_admission_queue_is_retried_and_concurrency_adapts(scripted_server, tmp_path, probe):
    # Seen: 3 of 12 cases became errors after 5 attempts in 4.5 s against a 2-slot queue.
    url = scripted_server(max_concurrent=2, slow_every=1, slow_s=0.05)
    res = probe(url, tmp_path, "--lengths", "200,400", "--depths", "0,50,100", "--trials", "2")
    assert res.returncode == 0, res.stderr
    assert all(r["status"] == "ok" for r in rows(tmp_path))
    md = (tmp_path / "report.md").read_text()
    assert "rejected" in md and "concurrency adapted down to" in md


def test_defaults_take_the_targets_trained_value_length_and_say_so(scripted_server, tmp_path, probe):
    url = scripted_server(trained_value_digits=3)
    res = probe(url, tmp_path, *SMALL)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    validate_summary(summary)
    assert summary["value_digits"] == 3 and "trained_value_digits" in summary["value_digits_source"]
    assert all(len(v) == 3 for r in rows(tmp_path) for v in r["expected"])
    assert (
        "3 digits, from the target's /get_server_info trained_value_digits"
        in (tmp_path / "report.md").read_text()
    )
    chosen = probe(url, tmp_path / "chosen", *SMALL, "--value-digits", "5")
    assert chosen.returncode == 0, chosen.stderr
    assert all(len(v) == 5 for r in rows(tmp_path / "chosen") for v in r["expected"])


def _whitespace_tokenizer(folder: Path, template: str) -> Path:
    """A tokenizer directory that counts whitespace words, as the scripted server does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template)
    return folder


# The scripted server's own rendering: "<|role|> content" per message, then "<|assistant|>".
SCRIPTED_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tokenizer_dir_counts_with_its_template_and_agrees_with_the_server(scripted_server, tmp_path, probe):
    pytest.importorskip("tokenizers")
    url = scripted_server(no_tokenize=1)
    no_tok = probe(url, tmp_path / "server", *SMALL)
    assert no_tok.returncode == 2 and "--tokenizer PATH" in no_tok.stderr
    tok = _whitespace_tokenizer(tmp_path / "tok", SCRIPTED_TEMPLATE)
    for i, path in enumerate((tok, tok / "tokenizer.json")):  # a directory, or its tokenizer.json
        res = probe(url, tmp_path / f"run{i}", *SMALL, "--tokenizer", str(path))
        assert res.returncode == 0, res.stderr
        summary = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        assert summary["length_mismatches"] == 0
        assert all(
            r["counted_length"] == r["length"] == r["prompt_tokens"] for r in rows(tmp_path / f"run{i}")
        )


def test_a_local_count_the_server_disagrees_with_is_flagged(scripted_server, tmp_path, probe):
    # Seen against transformers serve: every case counted 256, the server said 253, length_mismatches 0.
    pytest.importorskip("tokenizers")
    url = scripted_server(no_tokenize=1)
    tok = _whitespace_tokenizer(tmp_path / "tok", "<|bos|> <|sys|> <|x|> " + SCRIPTED_TEMPLATE)
    res = probe(url, tmp_path / "run", *SMALL, "--tokenizer", str(tok))
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["length_mismatches"] == summary["server_length_mismatches"] == 4
    assert all(r["prompt_tokens"] == r["length"] - 3 for r in rows(tmp_path / "run"))
    assert "WARNING" in (tmp_path / "run" / "report.md").read_text() and "WARNING" in res.stdout
