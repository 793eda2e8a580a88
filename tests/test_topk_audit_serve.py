"""``indexer topk-audit`` end to end: real ``needlescope serve`` processes on loopback return their
indexer logits with the top-k (``return_indexer_logits``); the CLI audits the saved responses.

The exact server passes; the same server with the planted ``fault:indexer_topk_overflow`` (a
cut-off-bin buffer that keeps first arrivals) is flagged with each row's recall, which a
brute-force float64 recomputation in this file confirms.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from needlescope.cli.main import app  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.emulate import IndexerCapture, emulate  # noqa: E402
from needlescope.serve.launch import ServerProcess  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import TINY_SERVE, save_random  # noqa: E402

TOPK = 2  # buffer 2k = 4 entries: crowded cut-off bins are common on the tiny model's rows
PROMPT = 300  # tokens: 75 compressed entries by the end of the prompt


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("ckpt"), seed=1, **TINY_SERVE)


def _prompt_ids() -> list[int]:
    return torch.randint(10, 3000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


def _serve_and_capture(ckpt, out_json, *patch: str) -> dict:
    args = ["--model", str(ckpt), "--port", "0", "--index-topk", str(TOPK), *patch]
    body = {
        "input_ids": _prompt_ids(),
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_indexer_topk": True,
        "return_indexer_logits": True,
    }
    with ServerProcess(args) as srv:
        plain = httpx.post(srv.url + "/generate", json={**body, "return_indexer_topk": False}, timeout=120)
        assert plain.status_code == 400 and plain.json()["error"]["param"] == "return_indexer_topk"
        r = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out_json.write_text(r.text)
    return r.json()


def _audit(path, out) -> tuple[int, dict]:
    """The CLI in this process (its exit codes and files; tests/test_topk_audit.py runs it as a child)."""
    res = CliRunner().invoke(app, ["indexer", "topk-audit", str(path), "--out", str(out)])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads((out / "topk_audit.json").read_text())


def _decoded(meta: dict, key: str, dtype: str) -> np.ndarray:
    import base64

    return np.frombuffer(base64.b64decode(meta[key]), dtype=dtype).reshape(meta[key + "_shape"])


def _brute_recall(x: np.ndarray, sel: np.ndarray) -> float:
    """Selected-value recall of one row by its definition, in plain Python floats."""
    cand = [(float(v), j) for j, v in enumerate(x) if v != -np.inf]
    k_eff = min(len(sel), len(cand))
    top = sorted(cand, key=lambda c: (-c[0], c[1]))[:k_eff]
    low = min(v for v, _ in cand)
    chosen = {int(j) for j in sel if j >= 0 and x[j] != -np.inf}
    return sum(float(x[j]) - low for j in chosen) / sum(v - low for v, _ in top)


def test_audit_passes_the_exact_server_and_flags_the_planted_overflow(ckpt, tmp_path):
    with ThreadPoolExecutor(2) as pool:  # two server processes start and answer side by side
        exact_run = pool.submit(_serve_and_capture, ckpt, tmp_path / "exact.json")
        planted_run = pool.submit(
            _serve_and_capture, ckpt, tmp_path / "planted.json", "--patch", "fault:indexer_topk_overflow"
        )
        exact, planted = exact_run.result(), planted_run.result()

    # The served logits are the ones an in-process capture of the same prompt ranks.
    model, _, _ = load_bundle(ckpt)
    cap = IndexerCapture(keep_scores=True)
    with emulate(model, Setting(index_topk=TOPK), capture=cap) as layers, torch.inference_mode():
        model(torch.tensor([_prompt_ids()]))
    served = _decoded(exact["meta_info"], "indexer_logits", "<f4")
    rows = PROMPT + 3 - 1
    assert served.shape == (rows, len(layers), rows // 4)  # the last row sees (rows - 1 + 1) // 4 entries
    for j, layer in enumerate(layers):
        _, score_rows = cap.score_rows(layer)
        for t in (3, 150, PROMPT - 1):  # before any entry, mid-prompt, the last prompt row
            want = score_rows[t].numpy()
            np.testing.assert_array_equal(served[t, j, : len(want)], want)
            assert np.all(served[t, j, len(want) :] == -np.inf)

    rc, report = _audit(tmp_path / "exact.json", tmp_path / "exact-audit")
    assert rc == 0 and report["exact"] and report["rows"] == rows * len(layers)
    assert report["recall_min"] == 1.0 and report["worst"] == []

    rc, report = _audit(tmp_path / "planted.json", tmp_path / "planted-audit")
    assert rc == 1 and not report["exact"] and report["rows_inexact"] > 0
    assert (tmp_path / "planted-audit" / "topk_audit.md").read_text().count("| row ") >= 1
    logits = _decoded(planted["meta_info"], "indexer_logits", "<f4")
    topk = _decoded(planted["meta_info"], "indexer_topk", "<i4")
    bad = [r for r in report["per_row"] if not r["exact"] and r["candidates"] > 0]
    # the rows before the first entry have nothing to select: not audited, never called exact
    assert report["rows_empty"] == sum(r["candidates"] == 0 for r in report["per_row"]) > 0
    assert report["worst"] == sorted(bad, key=lambda r: (r["recall"], -r["wrongly_dropped"], r["row"]))[:10]
    for r in bad:
        assert r["wrongly_dropped"] == r["wrongly_kept"] > 0  # a full selection with the wrong entries
        assert r["recall"] < 1.0 and r["overlap"] == (r["k_eff"] - r["wrongly_dropped"]) / r["k_eff"] < 1.0
        # The planted kernel drops only when its cut-off bin holds more than its 2k buffer.
        assert r["cutoff_bin_count"] > 2 * TOPK
        want = _brute_recall(logits[r["row"], r["layer"]], topk[r["row"], r["layer"]])
        assert r["recall"] == pytest.approx(want, rel=1e-12)
    assert report["recall_min"] == min(r["recall"] for r in bad)


def test_logits_payload_is_bounded_and_only_the_rows_asked_for_are_kept():
    from needlescope.serve.errors import BadValue
    from needlescope.serve.requests import MAX_INDEXER_LOGITS_BYTES, TopkRows

    rows, layers, k = 4000, 2, 8
    entries = rows // 4
    TopkRows().check(rows, layers, k, max_entries=entries)  # the top-k alone fits
    with pytest.raises(BadValue) as e:
        TopkRows(logits=True).check(rows, layers, k, max_entries=entries)  # 32 MB: over the cap
    assert e.value.field == "return_indexer_logits" and str(MAX_INDEXER_LOGITS_BYTES) in e.value.detail
    TopkRows(last=64, logits=True).check(rows, layers, k, max_entries=entries)
    assert TopkRows(last=8, logits=True).first_row(100) == 91  # at least 99 rows are fed
    assert TopkRows(positions=(40, 7), logits=True).first_row(100) == 7
    assert TopkRows(logits=True).first_row(100) == 0
