"""Bugs an outsider found in the white-box and investigation commands, one regression test each:
hostile input that must be one line and exit 2 (never a traceback), and a live investigation
whose endpoint goes down mid-run (errors never read as a clean run; the resumed run measures
again what the outage cut short)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PLANTED = Path(__file__).resolve().parent / "planted_bugs"


def _one_line_bad_input(code: int, err: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error:"), err


def test_a_prompt_file_that_is_not_utf8_is_bad_input(tmp_path, run_cli):
    bad = tmp_path / "prompt.json"
    bad.write_bytes(b"\x9d\xff[binary" + bytes(range(128, 200)))
    code, _, err = run_cli(
        "indexer", "rank-dump", "--model", "organism", "--prompt", str(bad), "--needle", "x",
        "--out", str(tmp_path / "rd"),
    )  # fmt: skip
    _one_line_bad_input(code, err)
    assert "not UTF-8" in err and "prompt.json" in err


def test_a_prompt_directory_is_named_a_directory(tmp_path, run_cli):
    code, _, err = run_cli(
        "indexer", "rank-dump", "--model", "organism", "--prompt", str(tmp_path), "--needle", "x",
        "--out", str(tmp_path / "rd"),
    )  # fmt: skip
    _one_line_bad_input(code, err)
    assert "is a directory" in err


def test_diff_input_ids_outside_the_vocabulary_are_bad_input(tmp_path, run_cli):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"input_ids": [1, -2, 99_999_999, 5], "needle_token_span": [0, 2]}))
    code, _, err = run_cli(
        "indexer", "diff", "--model", "organism", "--index-k", "fp8_e4m3", "--input-ids", str(ids),
        "--out", str(tmp_path / "d"),
    )  # fmt: skip
    _one_line_bad_input(code, err)
    assert "outside the checkpoint's vocabulary" in err and "99999999" in err
    assert not (tmp_path / "d" / "diff.json").exists()


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", ""])
def test_an_unknown_device_is_bad_input(tmp_path, run_cli, device):
    code, _, err = run_cli(
        "indexer", "rank-dump", "--model", "organism", "--prompt", str(EXAMPLES / "chat.json"),
        "--needle-span", "5:8", "--device", device, "--out", str(tmp_path / "rd"),
    )  # fmt: skip
    _one_line_bad_input(code, err)
    assert "--device" in err


def test_conform_refuses_an_unknown_device(tmp_path, run_cli):
    code, _, err = run_cli("kernels", "conform", "--impl", "torch", "--case", "nan", "--device", "tpu")
    _one_line_bad_input(code, err)
    assert "'tpu'" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("audit", "--model", "organism", "--checks", "routed_scale"),
        ("kernels", "conform", "--impl", "torch", "--case", "nan"),
    ],
)
def test_a_directory_as_the_output_file_is_bad_input_before_anything_runs(tmp_path, run_cli, argv):
    code, out, err = run_cli(*argv, "--out", str(tmp_path))
    _one_line_bad_input(code, err)
    assert "is a directory" in err and out == ""  # refused before the audit or any case ran


def _capture(path: Path, **extra) -> Path:
    import torch
    from safetensors.torch import save_file

    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    save_file({"logits": logits, "indices": torch.topk(logits, 4).indices, **extra}, str(path))
    return path


@pytest.mark.parametrize(
    ("lengths", "words"),
    [([-3, 5, 9], "row 0 has -3"), ([4, 99, 9], "row 1 has 99")],
)
def test_topk_audit_refuses_lengths_outside_the_row(tmp_path, run_cli, lengths, words):
    import torch

    cap = _capture(tmp_path / "cap.safetensors", lengths=torch.tensor(lengths, dtype=torch.int32))
    code, _, err = run_cli("indexer", "topk-audit", str(cap), "--out", str(tmp_path / "ta"))
    _one_line_bad_input(code, err)
    assert "lengths must lie in 0..16" in err and words in err


def test_topk_audit_of_no_rows_is_not_called_exact(tmp_path, run_cli):
    import torch
    from safetensors.torch import save_file

    cap = tmp_path / "empty.safetensors"
    save_file({"logits": torch.zeros(0, 16), "indices": torch.zeros(0, 4, dtype=torch.int64)}, str(cap))
    code, out, err = run_cli("indexer", "topk-audit", str(cap), "--out", str(tmp_path / "ta"))
    _one_line_bad_input(code, err)
    assert "no rows" in err and "exact" not in out
    # a good capture of the same shape still audits (the refusal is about the rows, not the format)
    code, out, _ = run_cli("indexer", "topk-audit", str(_capture(tmp_path / "ok.safetensors")), "--out", str(tmp_path / "ok"))  # fmt: skip
    assert code == 0 and "exact: 3 rows" in out


# -- a live investigation whose endpoint goes down mid-run ---------------------------------------


def _server(port: int = 0):
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    setting = Setting.parse(f"k=fp32 topk=16 patch={PLANTED / 'scorer_key_scale.py'}")
    cfg = ServeConfig(model="organism", port=port, setting=setting, threads=1, disclose_patch=False)
    return ServerProcess(cfg, timeout=300)


def _ledger(directory: Path, url: str) -> Path:
    from live_ledgers import live_suspect, write_live_ledger

    return write_live_ledger(
        directory, url, lengths="[512]", depths="[0, 50, 100]", trials=1, max_new_tokens=4,
        suspects=[live_suspect("index_keys_fp8", "fp8 keys", 'setting = "k=fp8_e4m3"')],
    )  # fmt: skip


def test_an_endpoint_that_goes_down_mid_run_is_never_a_clean_run(tmp_path, run_cli):
    """The server (a planted, undisclosed scoring bug no suspect names, so the characterization
    runs) stops after the first live answer. The run records the rest as errors and must not
    read as a clean run: the summary says how many were answered, a rerun while the endpoint is
    still down exits 1 naming the failures, and once the server is back (on another port) the
    resumed run measures the characterization again, on every case, not the outage's remains."""
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.investigate.run import run_investigation

    organism = load_bundle("organism")[:2]
    out = tmp_path / "out"
    server = _server().start()
    try:
        ledger = _ledger(tmp_path, server.url)

        def progress(phase, done, total, what=""):
            if phase == "probe live" and done >= 1 and server.proc.poll() is None:
                server.stop()  # the endpoint dies after its first answer

        first = run_investigation(ledger, out, progress, loaded=organism)
    finally:
        server.stop()
    sy = first.verdicts["symptom"]
    assert sy["cases"] == 3 and sy["errors"] == 2, sy
    char = first.verdicts["characterization"]
    assert char is not None and any(c["n"] == 0 for c in char["measured"]["cells"]), char["measured"]
    from needlescope.investigate.report.diagnosis import write_reports

    md = write_reports(first)[0].read_text()
    box = md.split("**Symptom:**", 1)[1].split("\n", 1)[0]
    assert "1 of 3 multiturn cases answered" in box and "2 live request(s) failed" in box, box

    # Rerun while the endpoint is still down: the failed cases are sent again, fail again, and
    # the command says so and exits 1 (never 0 as if the run were whole).
    # (--force: the library call above wrote the reports outside the CLI's manifest)
    code, stdout, err = run_cli("investigate", "run", str(ledger), "--out", str(out), "--force")
    assert code == 1, (stdout, err)
    assert "2 of 3 live request(s) failed" in err and "Traceback" not in err

    # The server comes back on another port: the same server resumes and answers everything.
    with _server() as again:
        _ledger(tmp_path, again.url)
        resumed = run_investigation(ledger, out, loaded=organism)
    sy = resumed.verdicts["symptom"]
    assert sy["errors"] == 0 and sy["cases"] == 3, sy
    cells = resumed.verdicts["characterization"]["measured"]["cells"]
    assert cells and all(c["n"] > 0 for c in cells), cells  # measured again, on every case
    by_length = {c["length"]: c for c in cells}
    assert by_length[512]["n"] == 3, cells
    live = [json.loads(x) for x in (out / "measure" / "live.jsonl").read_text().splitlines()]
    answered = [r["case_id"] for r in live if not r.get("error")]
    assert sorted(answered) == sorted(set(answered)) and len(answered) == 3  # none sent twice once answered
