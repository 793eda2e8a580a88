"""Numerics audit on the shipped organism: metrics are real, planted rewrites are flagged."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from needlescope.audit.run import audit_checkpoint  # noqa: E402
from needlescope.setting import Setting  # noqa: E402


def _metric(res: dict, name: str) -> float:
    return next(m["value"] for m in res["metrics"] if m["metric"].startswith(name))


def test_audit_checks_on_the_organism(tmp_path):
    patch = tmp_path / "twice.py"
    patch.write_text(
        "from needlescope.audit.substitutes import routed_scale_twice\n\n\ndef apply(model):\n"
        "    return routed_scale_twice(model)\n"
    )
    names = ["routed_scale", "hc_mix_bf16", "indexer_scores_bf16", "index_keys_fp8"]
    clean = {r["check"]: r for r in audit_checkpoint("organism", names, Setting(index_topk=16), 256)}
    assert not clean["routed_scale"]["flagged"]
    assert _metric(clean["routed_scale"], "effective routed scale") == pytest.approx(1.5, rel=1e-5)
    hc = clean["hc_mix_bf16"]
    assert 0 < _metric(hc, "mixing GEMM max relative Frobenius error") < 2**-7  # bf16 operands, not worse
    assert 0.0 <= _metric(hc, "compounded mean KL") and _metric(hc, "compounded top-1 agreement") <= 1.0
    fp8 = clean["index_keys_fp8"]
    assert _metric(fp8, "top-16 overlap with fp32, bf16 keys") >= _metric(
        fp8, "top-16 overlap with fp32, fp4_e2m1 keys"
    )
    assert 0 < _metric(clean["indexer_scores_bf16"], "score max relative error") < 0.05
    bad = audit_checkpoint("organism", ["routed_scale"], Setting(index_topk=16, patch=str(patch)), 256)[0]
    assert bad["flagged"] and "applied twice" in bad["why"]
    assert _metric(bad, "effective routed scale") == pytest.approx(1.5**2, rel=1e-5)


def test_audit_cli_refuses_unknown_check(run_cli):
    code, _, err = run_cli("audit", "--checks", "hc_mix_bf16,warp_drive")
    assert code == 2 and "warp_drive" in err


def test_audit_in_prefill_chunks_gives_the_one_pass_metrics():
    """Every check through the KV cache in chunks of 100 tokens (aligned to no window): the
    activations come per call, the compounding chunk by chunk; the metrics are the one-pass ones
    up to float rounding (the chunked forward reduces over fewer masked keys)."""
    names = ["routed_scale", "hc_mix_bf16", "decode_splitk_bf16", "indexer_scores_bf16", "index_keys_fp8"]
    runs = [audit_checkpoint("organism", names, Setting(index_topk=16), 256, chunk=c) for c in (None, 100)]
    for one, chunked in zip(*runs, strict=True):
        assert [m["metric"] for m in chunked["metrics"]] == [m["metric"] for m in one["metrics"]]
        assert chunked["flagged"] == one["flagged"], one["check"]
        for a, b in zip(one["metrics"], chunked["metrics"], strict=True):
            assert b["value"] == pytest.approx(a["value"], rel=1e-3, abs=1e-6), (one["check"], a["metric"])
