"""The explain path (``needlescope serve-probe-explain``: its rank dump of the failing case) survives a
deployment whose indexer leaves -inf and NaN scores, as the investigation does, and counts them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

NONFINITE_PATCH = """
from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states).clone()
            scores[..., 8:] = float("-inf")   # a kernel that drops candidates past its buffer
            scores[..., 3] = float("nan")     # and one slot it never writes
            return scores

        return forward

    return wrap_scorers(model, wrap)
"""


def test_serve_probe_explain_with_a_nonfinite_patch_completes_and_reports_the_counts(
    tmp_path, run_cli_completed
):
    from needlescope.dsa.rankdump import validate_rankdump
    from needlescope.testing.checkpoints import save_random

    model = save_random(tmp_path / "model", seed=0, hidden_size=64, moe_intermediate_size=64)
    patch = tmp_path / "nonfinite.py"
    patch.write_text(NONFINITE_PATCH)
    out = tmp_path / "spe"
    argv = ["serve-probe-explain", "--model", str(model), "--out", str(out)]
    argv += ["--lengths", "200", "--trials", "1", "--deploy-index-topk", "8", "--deploy-patch", str(patch)]
    res = run_cli_completed(*argv)  # in-process: its servers are children, as on the shell
    assert res.returncode == 0, res.stderr[
        -2000:
    ]  # before: ValueError "a visible entry has a non-finite score"
    dump = json.loads((out / "rankdump.json").read_text())
    validate_rankdump(dump)
    counts = [p["nonfinite"] for layer in dump["layers"] for p in layer["positions"] if "nonfinite" in p]
    assert counts and all(c["nan"] == 1 and c["neg_inf"] > 0 and c["pos_inf"] == 0 for c in counts), counts
    text = (out / "DIAGNOSIS.md").read_text()
    assert "Non-finite indexer scores" in text and "1 NaN" in text
