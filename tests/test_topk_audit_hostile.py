"""Issue 54, items 3 and 9: ``indexer topk-audit`` on captures with nothing to select and on hostile JSON.

A capture of all-NaN logits, all ``-inf`` logits or a selection of width 0 was called exact, exit
0: an empty comparison passed the audit. Rows without candidates, k = 0 and NaN logits are now
flagged (exit 1, each row's ``problem`` said). A 100,000-deep JSON array and a position of 1e30
were tracebacks; each is one line, exit 2.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

NINF = -np.inf


def _save(path, **tensors):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize(
    ("logits", "indices", "problem"),
    [
        (np.full((2, 4), np.nan, np.float32), np.array([[0, 1], [2, 3]], np.int32), "4 NaN logits"),
        (np.full((2, 4), np.nan, np.float32), np.full((2, 2), -1, np.int32), "4 NaN logits"),
        (
            np.full((2, 4), NINF, np.float32),
            np.full((2, 2), -1, np.int32),
            "nothing to audit: none of the 2 rows",
        ),
        (
            np.array([[5, 3, 1, 0], [1, 2, 3, 4]], np.float32),
            np.zeros((2, 0), np.int32),
            "empty selection (k = 0)",
        ),
        (
            np.array([[5, np.nan, 1, 0], [1, 2, 3, 4]], np.float32),
            np.array([[0, 2], [3, 2]], np.int32),
            "1 NaN logits",
        ),
    ],
    ids=["all-nan", "all-nan-nothing-selected", "all-minus-inf", "width-0", "one-nan"],
)
def test_a_capture_with_nothing_to_select_or_nan_logits_is_flagged_never_exact(
    run_cli, tmp_path, logits, indices, problem
):
    capture = _save(tmp_path / "c.safetensors", logits=logits, indices=indices)
    code, stdout, stderr = run_cli("indexer", "topk-audit", str(capture), "--out", str(tmp_path / "o"))
    assert code == 1, stdout + stderr
    report = json.loads((tmp_path / "o" / "topk_audit.json").read_text())
    assert not report["exact"] and not any(r["exact"] for r in report["per_row"] if r["problem"])
    assert problem in stdout and problem in (tmp_path / "o" / "topk_audit.md").read_text()
    assert "every selection is the exact" not in stdout


def test_rows_without_candidates_are_never_exact_and_the_others_still_judged(run_cli, tmp_path):
    """An early query row of a real capture sees no entry yet: it is not audited (never called
    exact); the capture's verdict rests on the rows that had something to select."""
    logits = np.array([[5, 3, 1, 0], [1, 2, 3, 4], [NINF, NINF, NINF, NINF]], np.float32)
    capture = _save(tmp_path / "c.safetensors", logits=logits, indices=np.array([[0, 1], [-1, -1], [-1, -1]], np.int32),
                    lengths=np.array([4, 0, 4], np.int32))  # fmt: skip
    code, stdout, _ = run_cli("indexer", "topk-audit", str(capture), "--out", str(tmp_path / "o"))
    assert code == 0, stdout
    report = json.loads((tmp_path / "o" / "topk_audit.json").read_text())
    assert [r["exact"] for r in report["per_row"]] == [True, False, False] and report["rows_empty"] == 2
    assert all(r["problem"].startswith("no candidates") for r in report["per_row"][1:])
    assert "exact: 1 rows audited, every selection is the exact top-2; 2 rows had no candidate" in stdout


def _serve_response(positions) -> dict:
    logits = np.array([[[1, 2, NINF]], [[3, 1, 2]]], "<f4")
    topk = np.array([[[1, 0]], [[0, 2]]], "<i4")
    return {"meta_info": {
        "indexer_topk": base64.b64encode(topk.tobytes()).decode(), "indexer_topk_shape": [2, 1, 2],
        "indexer_logits": base64.b64encode(logits.tobytes()).decode(), "indexer_logits_shape": [2, 1, 3],
        "indexer_topk_positions": positions,
    }}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (json.dumps(_serve_response([1e30, 2])), "must be a list of integer positions"),
        (json.dumps(_serve_response([10**30, 2])), "outside 0..2147483647"),
        (json.dumps(_serve_response([-1, 2])), "outside 0..2147483647"),
    ],
    ids=["deep-array", "position-1e30-float", "position-1e30-int", "negative-position"],
)
def test_hostile_json_is_one_line_and_exit_2(run_cli, tmp_path, body, message):
    (tmp_path / "r.json").write_text(body)
    code, stdout, stderr = run_cli(
        "indexer", "topk-audit", str(tmp_path / "r.json"), "--out", str(tmp_path / "o")
    )
    assert code == 2, stdout + stderr
    assert len(stderr.strip().splitlines()) == 1 and message in stderr, stderr
    assert not (tmp_path / "o" / "topk_audit.json").exists()


def test_positions_in_a_safetensors_capture_and_token_counts_are_bounded(run_cli, tmp_path):
    logits = np.array([[5, 3, 1, 0]], np.float32)
    for positions, message in ((np.array([1e30], np.float32), "positions must be integers"),
                               (np.array([2**40], np.int64), "outside 0..2147483647")):  # fmt: skip
        capture = _save(tmp_path / "c.safetensors", logits=logits, indices=np.array([[0, 1]], np.int32),
                        positions=positions)  # fmt: skip
        code, _, stderr = run_cli("indexer", "topk-audit", str(capture), "--out", str(tmp_path / "o"))
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and message in stderr, stderr
    rows = np.zeros((4, 1, 2), "<i4")
    resp = {"meta_info": {"prompt_tokens": 1e30, "completion_tokens": 2,
                          "indexer_topk": base64.b64encode(rows.tobytes()).decode()}}  # fmt: skip
    (tmp_path / "sglang.json").write_text(json.dumps(resp))
    capture = _save(tmp_path / "l.safetensors", logits=logits.reshape(1, 1, 4))
    code, _, stderr = run_cli("indexer", "topk-audit", str(capture), "--indices", str(tmp_path / "sglang.json"),
                              "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "must be token counts" in stderr, stderr
