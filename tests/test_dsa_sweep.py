"""Fix sweep: cost order, restore/cheapest logic on hand-made rates, and a tiny grid on a random V4."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.sweep import (  # noqa: E402
    SweepConfig,
    cheapest_setting,
    render_sweep_md,
    restored_to,
    run_sweep,
    setting_cost,
    summarize_runs,
    validate_sweep,
)
from needlescope.errors import BadInput  # noqa: E402
from needlescope.organism.config import TINY_OVERRIDES  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

TINY = TINY_OVERRIDES


def _S(k: str, q: str, topk: int) -> Setting:
    return Setting(index_k=k, index_q=q, index_topk=topk)


def test_cost_order_topk_first_then_bits():
    settings = [
        _S("fp32", "fp32", 16),
        _S("fp4_e2m1", "fp4_e2m1", 32),
        _S("fp4_e2m1", "fp4_e2m1", 16),
        _S("bf16", "fp8_e4m3", 16),
    ]
    assert sorted(settings, key=setting_cost) == [
        _S("fp4_e2m1", "fp4_e2m1", 16),
        _S("bf16", "fp8_e4m3", 16),
        _S("fp32", "fp32", 16),
        _S("fp4_e2m1", "fp4_e2m1", 32),
    ]


def test_restored_to_is_the_longest_unbroken_run():
    assert restored_to({256: 1.0, 512: 0.95, 1024: 0.5, 2048: 1.0}, 0.9) == 512
    assert restored_to({256: 0.5, 512: 1.0}, 0.9) is None
    assert restored_to({256: 1.0, 512: None, 1024: 0.9}, 0.9) == 1024  # unscored lengths do not break it


def test_cheapest_setting_among_those_reaching_the_target():
    rates = {
        _S("fp4_e2m1", "fp4_e2m1", 16): 0.5,
        _S("bf16", "bf16", 16): 0.95,
        _S("fp4_e2m1", "fp4_e2m1", 64): 1.0,
    }
    assert cheapest_setting(rates, 0.9) == (_S("bf16", "bf16", 16), 0.95)
    assert cheapest_setting(rates, 0.99) == (_S("fp4_e2m1", "fp4_e2m1", 64), 1.0)
    assert cheapest_setting({_S("fp32", "fp32", 8): None}, 0.5) is None


def _run(case, length, selected, layers, correct=None):
    return {
        "case_id": case,
        "length": length,
        "index_k": "fp32",
        "index_q": "fp32",
        "index_topk": 8,
        "selected": selected,
        "layers": layers,
        "answer": None,
        "answer_correct": correct,
    }


def test_summarize_runs_excludes_unscored_cases_from_the_rate():
    lay = lambda lid, sel, rank: {"layer": lid, "selected": sel, "best_rank": rank, "margin_frac": 0.1}  # noqa: E731
    runs = [
        _run("a", 256, True, [lay(1, True, 2), lay(3, True, 1)], True),
        _run("b", 256, False, [lay(1, True, 3), lay(3, False, 20)], False),
        _run("c", 256, None, [], False),  # needle not visible anywhere: sliding window only
    ]
    (cell,) = summarize_runs(runs, [1, 3], generate=True)
    assert (cell["cases"], cell["scored"], cell["unscored"], cell["selected"]) == (3, 2, 1, 1)
    assert cell["selection_rate"] == 0.5 and cell["answer_recall"] == pytest.approx(1 / 3)
    by = {p["layer"]: p for p in cell["per_layer"]}
    assert by[1]["rate"] == 1.0 and by[3]["rate"] == 0.5 and by[3]["median_best_rank"] == pytest.approx(10.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(index_k=("fp5",)), "unknown key precision"),
        (dict(score_dtype="fp64"), "score dtype"),
        (dict(target_length=999), "target length"),
        (dict(index_topk=(8, 8)), "duplicates"),
        (dict(index_topk=(0,)), "positive"),
        (dict(target_rate=0.0), "target rate"),
        (dict(kind="haiku"), "case kind"),
    ],
)
def test_sweep_config_rejects_bad_grids(kwargs, match):
    base = dict(lengths=(128, 256), index_topk=(8,))
    with pytest.raises(BadInput, match=match):
        SweepConfig(**{**base, **kwargs})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random(tmp_path_factory.mktemp("tiny_v4_sweep"), seed=2, **TINY)
    model, tok, _ = load_bundle(path)
    return model, tok


def test_tiny_grid_without_generation(tiny):
    model, tok = tiny
    cfg = SweepConfig(
        lengths=(128, 256),
        index_topk=(2, 64),
        index_k=("fp32", "fp4_e2m1"),
        index_q=("fp32",),
        kind="single",
        depths=(30.0,),
        generate=False,
        target_rate=0.9,
    )
    res = run_sweep(model, tok, cfg, model_label="tiny")
    validate_sweep(res)
    assert len(res["cells"]) == 2 * 2 * 2 and len(res["runs"]) == 8
    assert res["target_length"] == 256 and res["generate"] is False
    # index_topk 64 >= every visible count (256 // 4): the needle is always selected.
    for s in res["settings"]:
        if s["index_topk"] == 64:
            assert s["rate_at_target"] == 1.0 and s["restored_to"] == 256
    # The named cheapest setting reaches the target, and no cheaper one does.
    ch = res["cheapest"]
    rates = {(s["index_k"], s["index_q"], s["index_topk"]): s["rate_at_target"] for s in res["settings"]}
    key = (ch["index_k"], ch["index_q"], ch["index_topk"])
    assert rates[key] >= 0.9
    assert all(
        r is None or r < 0.9 for s, r in rates.items() if setting_cost(_S(*s)) < setting_cost(_S(*key))
    )
    assert res["baseline"] == {"index_k": "fp4_e2m1", "index_q": "fp32", "index_topk": 2}
    assert any("cheapest setting" in v for v in res["verdict"])
    md = render_sweep_md(res)
    assert "## Verdict" in md and md.count("| k=") == 4


def test_tiny_grid_with_generation_reports_answer_recall(tiny):
    model, tok = tiny
    cfg = SweepConfig(lengths=(128,), index_topk=(64,), kind="single", depths=(50.0,), max_new_tokens=3)
    res = run_sweep(model, tok, cfg)
    validate_sweep(res)
    (cell,) = res["cells"]
    assert isinstance(cell["answers_correct"], int) and 0.0 <= cell["answer_recall"] <= 1.0
    (run,) = res["runs"]
    assert isinstance(run["answer"], str) and isinstance(run["answer_correct"], bool)
    assert "/" in render_sweep_md(res)
