"""The top-k audit's math on hand-made rows (ties, -inf padding, rows shorter than k, invalid
slots), against a brute-force reading of its definitions on random tie-heavy rows; the capture
loaders; the planted overflow kernel; and the CLI's exit codes."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from needlescope.dsa.topk_audit import audit_rows, float32_key, reference_topk
from needlescope.errors import BadInput

NINF = -np.inf


def _one(x, sel, **kw) -> dict:
    out = audit_rows(np.array([x], dtype=np.float32), np.array([sel]), **kw)
    return {k: v[0].item() for k, v in out.items()}


def test_any_choice_among_ties_at_the_cutoff_is_exact():
    x = [5, 3, 3, 3, 1]
    for sel in ([0, 1, 2], [0, 3, 1], [2, 0, 3]):
        r = _one(x, sel)
        assert r["exact"] and r["recall"] == 1.0
        assert (r["ties_at_cutoff"], r["tie_slots"], r["kth_value"]) == (3, 2, 3.0)
    r = _one(x, [0, 1, 4])  # a tie slot given to the value below the cut-off
    assert (r["wrongly_kept"], r["wrongly_dropped"], r["exact"]) == (1, 1, False)
    assert r["recall"] == pytest.approx((4 + 2 + 0) / (4 + 2 + 2))  # shifted by the row's floor 1
    r = _one(x, [1, 2, 3])  # three ties, the one entry above dropped
    assert (r["wrongly_kept"], r["wrongly_dropped"]) == (1, 1)
    assert reference_topk(np.array([x], np.float32), 3).tolist() == [[0, 1, 2]]  # ties by column


def test_minus_inf_padding_is_never_a_candidate_and_short_rows_need_every_candidate():
    x = [2, NINF, 1, NINF, NINF, NINF]
    r = _one(x, [0, 2, -1])
    assert r["exact"] and (r["candidates"], r["k_eff"], r["selected_valid"]) == (2, 2, 2)
    r = _one(x, [0, 1, 2])  # selecting padding is an invalid slot
    assert (r["invalid_selected"], r["wrongly_kept"], r["wrongly_dropped"], r["exact"]) == (1, 1, 0, False)
    r = _one(x, [0, -1, -1])  # a row shorter than k must still return all its candidates
    assert (r["wrongly_kept"], r["wrongly_dropped"]) == (0, 1)
    assert r["recall"] == pytest.approx(1.0)  # the dropped entry sits at the floor: recall 1, not exact
    assert not r["exact"]
    r = _one([NINF] * 4, [-1, -1])  # nothing to select: never exact (issue 54), the counts stay 0
    assert not r["exact"] and r["k_eff"] == 0 and r["recall"] == 1.0 and np.isnan(r["kth_value"])
    assert (r["wrongly_kept"], r["wrongly_dropped"]) == (0, 0)
    none = audit_rows(np.zeros((2, 0), np.float32), np.array([[-1], [0]]))  # rows with no columns at all
    assert none["exact"].tolist() == [False, False] and none["invalid_selected"].tolist() == [0, 1]


def test_lengths_out_of_range_repeats_and_nan_are_handled():
    x = [1, 2, 3, 9, 9]
    assert _one(x, [2, 1], lengths=np.array([3]))["exact"]  # columns 3-4 are past the row's length
    r = _one(x, [3, 4], lengths=np.array([3]))
    assert (r["invalid_selected"], r["wrongly_dropped"]) == (2, 2)
    r = _one(x, [4, 4])  # a repeated column fills one slot
    assert (r["invalid_selected"], r["wrongly_kept"], r["wrongly_dropped"]) == (1, 1, 1)
    r = _one(x, [4, 7])
    assert r["invalid_selected"] == 1
    r = _one([np.nan, 1, 2], [2, 1])  # NaN is no candidate, and a row with NaN logits is never exact
    assert not r["exact"] and r["candidates"] == 2 and r["nan_logits"] == 1
    assert (r["wrongly_kept"], r["wrongly_dropped"]) == (0, 0)
    assert _one([1, 2, np.nan], [1, 0], lengths=np.array([2]))["exact"]  # a NaN past the length is unused


def test_recall_is_shifted_for_negative_logits_and_plus_inf_ranks_first():
    r = _one([-1, -2, -4], [1])
    assert r["recall"] == pytest.approx((-2 + 4) / (-1 + 4)) and not r["exact"]
    r = _one([np.inf, 5, 1], [0])
    assert r["exact"] and r["recall"] == 1.0 and r["kth_value"] == np.inf
    r = _one([np.inf, 5, 1], [1])
    assert not r["exact"] and r["recall"] == 1.0  # +inf counts as the best finite value in the sums


def test_cutoff_bin_counts_entries_sharing_the_kth_values_bin():
    x = [1.0, 1.01, 1.02, 1.03, 4.0, 0.1]
    r = _one(x, [4, 3], bin_bits=11)
    assert r["exact"] and r["ties_at_cutoff"] == 1 and r["cutoff_bin_count"] == 4
    assert _one(x, [4, 3], bin_bits=32)["cutoff_bin_count"] == 1
    keys = float32_key(np.array([-np.inf, -2.0, -0.0, 0.0, 1e-30, 3.0], np.float32))
    assert np.all(np.diff(keys.astype(np.int64)) > 0)


def _brute(x: np.ndarray, sel: np.ndarray) -> tuple[int, int, float]:
    """(wrongly kept, wrongly dropped, recall) of one row read straight from the definitions."""
    cand = [j for j in range(len(x)) if not np.isnan(x[j]) and x[j] != NINF]
    k_eff = min(len(sel), len(cand))
    if k_eff == 0:
        return sum(1 for j in sel if j >= 0), 0, 1.0
    top = sorted(cand, key=lambda j: (-float(x[j]), j))[:k_eff]
    vk = float(x[top[-1]])
    chosen = {int(j) for j in sel if 0 <= j < len(x) and j in cand}
    invalid = sum(1 for j in sel if j >= 0) - len(chosen)
    above = [j for j in cand if x[j] > vk]
    slots = k_eff - len(above)
    ties_chosen = sum(1 for j in chosen if x[j] == vk)
    kept = invalid + sum(1 for j in chosen if x[j] < vk) + max(0, ties_chosen - slots)
    dropped = sum(1 for j in above if j not in chosen) + max(0, slots - ties_chosen)
    low = min(float(x[j]) for j in cand)
    den = sum(float(x[j]) - low for j in top)
    recall = sum(float(x[j]) - low for j in chosen) / den if den > 0 else len(chosen) / k_eff
    return kept, dropped, recall


def test_vectorized_audit_matches_the_definitions_on_random_tie_heavy_rows():
    rng = np.random.default_rng(0)
    R, L, k = 300, 24, 6
    x = rng.integers(-3, 4, size=(R, L)).astype(np.float32)  # seven values: ties everywhere
    x[rng.random((R, L)) < 0.3] = NINF
    sel = rng.integers(-1, L + 2, size=(R, k))
    ref = reference_topk(x, k)
    sel[::3] = ref[::3]  # every third row exact by construction
    out = audit_rows(x, sel)
    for i in range(R):
        kept, dropped, recall = _brute(x[i], sel[i])
        assert (out["wrongly_kept"][i], out["wrongly_dropped"][i]) == (kept, dropped), i
        assert out["recall"][i] == pytest.approx(recall, abs=1e-12), i
        assert out["exact"][i] == (kept == 0 and dropped == 0 and out["candidates"][i] > 0)
        k_eff = out["k_eff"][i]
        assert out["overlap"][i] == (1.0 if k_eff == 0 else (k_eff - dropped) / k_eff)
    assert out["exact"][::3].all() and not out["exact"].all()


def test_planted_overflow_kernel_keeps_first_arrivals_of_a_crowded_cutoff_bin():
    torch = pytest.importorskip("torch")
    from needlescope.dsa.faults.indexer_topk_overflow import overflowing_topk

    row = torch.tensor([[1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 8.0, 0.1]])  # six entries share one bin
    got = overflowing_topk(row, 2)  # buffer of 4: entries 4 and 5 never reach it
    assert got.indices.tolist() == [[6, 3]] and got.values.tolist() == [[8.0, row[0, 3].item()]]
    r = _one(row[0].numpy(), got.indices[0].numpy())
    assert (r["wrongly_kept"], r["wrongly_dropped"], r["cutoff_bin_count"]) == (1, 1, 6)
    spread = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0]])  # one entry per bin: exact
    assert torch.equal(overflowing_topk(spread, 3).indices, spread.topk(3).indices)


# ---- capture files and the CLI ---------------------------------------------------------------


def _save(path, **tensors):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({k: torch.as_tensor(v) for k, v in tensors.items()}, str(path))
    return path


def test_safetensors_with_layers_and_an_sglang_response_load_per_row_and_layer(tmp_path):
    from needlescope.dsa.topk_audit_input import load_capture

    logits = np.array([[[3, 1, 2], [1, 2, 3]], [[0, 5, NINF], [4, 4, 1]]], np.float32)  # [R=2, layers=2, L=3]
    sel = np.array([[[0, 2], [2, 1]], [[1, 0], [1, 0]]], np.int32)
    data = load_capture(
        _save(tmp_path / "c.safetensors", logits=logits, topk_indices=sel, seq_lens=np.array([3, 2]))
    )
    assert (
        data.logits.shape == (4, 3)
        and data.row.tolist() == [0, 0, 1, 1]
        and data.layer.tolist() == [0, 1, 0, 1]
    )
    assert data.lengths.tolist() == [3, 3, 2, 2]
    one = load_capture(tmp_path / "c.safetensors", layer=1)
    assert one.selected.tolist() == [[2, 1], [1, 0]]

    # SGLang: its response holds the selections of every fed row; the logits file picks rows 1 and 3.
    rows = np.zeros((4, 2, 2), "<i4")
    rows[1], rows[3] = sel[0], sel[1]
    resp = {"meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                          "indexer_topk": base64.b64encode(rows.tobytes()).decode()}}  # fmt: skip
    (tmp_path / "sglang.json").write_text(json.dumps(resp))
    path = _save(tmp_path / "l.safetensors", logits=logits, positions=np.array([1, 3]))
    data = load_capture(path, indices_json=tmp_path / "sglang.json")
    assert data.selected.tolist() == sel.reshape(4, 2).tolist() and data.position.tolist() == [1, 1, 3, 3]
    assert data.format == "safetensors+sglang"

    # vLLM PR #49555: base64 of .npy bytes in choices[0].indexer_topk.
    npy = io.BytesIO()
    np.save(npy, rows)
    vllm = {"choices": [{"index": 0, "indexer_topk": base64.b64encode(npy.getvalue()).decode()}]}
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    data = load_capture(path, indices_json=tmp_path / "vllm.json")
    assert data.format == "safetensors+vllm" and data.selected.tolist() == sel.reshape(4, 2).tolist()
    flat = _save(tmp_path / "flat.safetensors", logits=np.ascontiguousarray(logits[:, 0]))
    with pytest.raises(BadInput, match=r"save the logits as \[R, layers, L\]"):
        load_capture(flat, indices_json=tmp_path / "vllm.json")


def test_a_serve_response_loads_with_its_chosen_positions(tmp_path):
    from needlescope.dsa.topk_audit_input import load_capture

    logits = np.array([[[1, 2, NINF]], [[3, 1, 2]]], "<f4")  # [rows=2, layers=1, W=3]
    topk = np.array([[[1, 0]], [[0, 2]]], "<i4")
    meta = {
        "indexer_topk": base64.b64encode(topk.tobytes()).decode(),
        "indexer_topk_shape": [2, 1, 2],
        "indexer_logits": base64.b64encode(logits.tobytes()).decode(),
        "indexer_logits_shape": [2, 1, 3],
        "indexer_topk_positions": [7, 9],
    }
    (tmp_path / "r.json").write_text(json.dumps({"meta_info": meta}))
    data = load_capture(tmp_path / "r.json")
    assert (
        data.format == "needlescope-serve"
        and data.position.tolist() == [7, 9]
        and data.layer.tolist() == [0, 0]
    )
    assert audit_rows(data.logits, data.selected)["exact"].all()
    (tmp_path / "bad.json").write_text(json.dumps({"meta_info": {**meta, "indexer_logits_shape": [2, 1, 4]}}))
    with pytest.raises(BadInput, match="does not decode to shape"):
        load_capture(tmp_path / "bad.json")


def test_bad_captures_say_what_is_wrong(tmp_path):
    from needlescope.dsa.topk_audit_input import load_capture

    with pytest.raises(BadInput, match="no tensor 'indices' or 'topk_indices'"):
        load_capture(_save(tmp_path / "a.safetensors", logits=np.zeros((2, 3), np.float32)))
    with pytest.raises(BadInput, match="disagree on rows"):
        load_capture(_save(tmp_path / "b.safetensors", logits=np.zeros((2, 3), np.float32), indices=np.zeros((3, 1), np.int32)))  # fmt: skip
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(BadInput, match="not a readable safetensors"):
        load_capture(tmp_path / "junk.safetensors")
    (tmp_path / "sglang.json").write_text(json.dumps({"meta_info": {"indexer_topk": "AAAA"}}))
    with pytest.raises(BadInput, match="SGLang response carries only the selections"):
        load_capture(tmp_path / "sglang.json")


def test_cli_exits_1_on_an_inexact_capture_and_2_on_bad_input(tmp_path):
    from needlescope.cli.main import app

    logits = np.array([[5, 3, 3, 1], [1, 2, 3, 4]], np.float32)
    runner = CliRunner()
    good = _save(tmp_path / "good.safetensors", logits=logits, indices=np.array([[0, 2], [3, 2]], np.int32))
    res = runner.invoke(app, ["indexer", "topk-audit", str(good), "--out", str(tmp_path / "o1")])
    assert res.exit_code == 0, res.output
    bad = _save(tmp_path / "bad.safetensors", logits=logits, indices=np.array([[0, 2], [3, 0]], np.int32))
    res = runner.invoke(app, ["indexer", "topk-audit", str(bad), "--out", str(tmp_path / "o2")])
    assert res.exit_code == 1 and "row 1: recall 0.6000" in res.output  # (3 + 0) / (3 + 2)
    report = json.loads((tmp_path / "o2" / "topk_audit.json").read_text())
    assert report["rows_inexact"] == 1 and [r["row"] for r in report["worst"]] == [1]
    proc = subprocess.run(
        [sys.executable, "-m", "needlescope.cli.main", "indexer", "topk-audit", str(tmp_path / "missing.safetensors")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
