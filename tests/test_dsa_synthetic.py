"""Synthetic planted-needle mode: the planting is exact, the grid is seeded, bad configs are refused."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.synthetic import (  # noqa: E402
    SYNTHETIC_SCHEMA,
    Precision,
    SyntheticConfig,
    make_trial,
    needle_rank,
    parse_precisions,
    render_synthetic_md,
    run_synthetic,
)
from needlescope.errors import BadInput  # noqa: E402

SMALL = dict(entries=(1024,), heads=8, dim=128, topk=64, trials=4, chunk=256)


def test_abs_margin_is_planted_exactly():
    cfg = SyntheticConfig(
        **SMALL, margins=(0.25,), margin_unit="abs", margin_ref="best", precisions=(Precision(),)
    )
    for trial in range(3):
        tr = make_trial(cfg, 1024, 0.25, trial)
        assert tr.margin_abs.shape == (1,)
        assert float(tr.margin_abs[0]) == pytest.approx(0.25, rel=1e-4)
        # Above the best distractor: rank 1 in fp32, whatever the trial.
        assert int(needle_rank(tr, Precision())[0]) == 1


def test_fp32_keeps_exactly_the_needles_above_the_cutoff():
    cfg = SyntheticConfig(
        **SMALL, margins=(-0.01, 0.01), margin_unit="spread", margin_ref="kth", precisions=(Precision(),)
    )
    res = {r["margin"]: r for r in run_synthetic(cfg)["results"]}
    assert res[0.01]["kept_rate"] == 1.0 and res[0.01]["worst_rank"] <= cfg.topk
    assert res[-0.01]["kept_rate"] == 0.0 and res[-0.01]["mean_rank"] > cfg.topk


def test_fp8_survival_is_monotone_in_margin():
    # fp8 with one scale per vector is positively homogeneous, so on the same trials a larger
    # margin can only raise the needle's quantised score: kept counts never decrease.
    margins = (-0.004, -0.001, 0.0, 0.001, 0.004)
    cfg = SyntheticConfig(
        **SMALL,
        margins=margins,
        margin_unit="spread",
        margin_ref="kth",
        precisions=parse_precisions("fp8_e4m3"),
    )
    res = {r["margin"]: r["kept"] for r in run_synthetic(cfg)["results"]}
    kept = [res[m] for m in margins]
    assert kept == sorted(kept)


def test_grid_is_seeded_and_schema_shaped():
    cfg = SyntheticConfig(
        **SMALL, margins=(0.0, 0.002), margin_ref="kth", precisions=parse_precisions("fp32,bf16,fp4_e2m1")
    )
    a, b = run_synthetic(cfg), run_synthetic(cfg)
    assert a["results"] == b["results"]
    assert len(a["results"]) == len(cfg.entries) * len(cfg.margins) * len(cfg.precisions)
    for r in a["results"]:
        assert set(SYNTHETIC_SCHEMA["properties"]["results"]["items"]["required"]) <= set(r)
        assert r["rows"] == cfg.trials * cfg.queries
        assert 0.0 <= r["kept_rate"] <= 1.0 and r["kept_ci95"][0] <= r["kept_rate"] <= r["kept_ci95"][1]
    json.dumps(a, allow_nan=False)
    md = render_synthetic_md(a)
    assert "k=fp4_e2m1 q=fp4_e2m1 acc=fp32" in md and "1024 entries" in md


def test_chunking_does_not_change_results():
    base = dict(SMALL, chunk=1024)
    cfg_a = SyntheticConfig(**base, margins=(0.001,), margin_ref="kth", precisions=parse_precisions("bf16"))
    cfg_b = SyntheticConfig(
        **dict(base, chunk=100), margins=(0.001,), margin_ref="kth", precisions=cfg_a.precisions
    )
    assert run_synthetic(cfg_a)["results"] == run_synthetic(cfg_b)["results"]


def test_several_query_rows_share_keys_and_bound_the_margin():
    cfg = SyntheticConfig(
        **dict(SMALL, trials=2), queries=3, margins=(0.3,), margin_unit="abs", precisions=(Precision(),)
    )
    tr = make_trial(cfg, 1024, 0.3, 0)
    assert tr.q.shape == (3, 8, 128) and tr.margin_abs.shape == (3,)
    assert float(tr.margin_abs.min()) == pytest.approx(0.3, rel=1e-4)
    assert bool((tr.margin_abs >= 0.3 - 1e-4).all())


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(dim=64, precisions=(Precision("fp4_e2m1", "fp4_e2m1"),)), "dim must be 128"),
        (dict(entries=(64,)), "must exceed topk"),
        (dict(entries=(1 << 19,)), "entries must be integers"),
        (dict(margin_unit="percent"), "margin_unit"),
        (dict(margin_ref="worst"), "margin_ref"),
        (dict(heads=0), "heads must be a positive integer"),
    ],
)
def test_bad_configs_are_refused(kwargs, fragment):
    with pytest.raises(BadInput, match=fragment):
        SyntheticConfig(**{**SMALL, **kwargs})


def test_parse_precisions():
    assert parse_precisions("fp8_e4m3:bf16:bf16, fp4_e2m1") == (
        Precision("fp8_e4m3", "bf16", "bf16"),
        Precision("fp4_e2m1", "fp4_e2m1", "fp32"),
    )
    with pytest.raises(BadInput, match="Did you mean"):
        parse_precisions("fp8_e4m4")
    with pytest.raises(BadInput, match="unknown score dtype"):
        parse_precisions("fp32:fp32:fp8")


def test_cli_synthetic(tmp_path, run_cli):
    out = tmp_path / "syn"
    code, stdout, err = run_cli("indexer", "synthetic", "--entries", "512", "--heads", "4", "--topk", "32",
        "--margins", "0,0.01", "--margin-ref", "kth", "--trials", "2", "--precisions", "fp32,fp8_e4m3",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    obj = json.loads((out / "synthetic.json").read_text())
    assert obj["config"]["entries"] == [512] and len(obj["results"]) == 4
    assert (out / "synthetic.md").read_text().startswith("# Synthetic")
    code, _, err = run_cli("indexer", "synthetic", "--precisions", "fp5", "--out", str(out))
    assert code == 2 and "unknown key precision" in err and len(err.strip().splitlines()) == 1
