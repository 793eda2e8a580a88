"""Selection stability: set math on hand-made top-k rows, and reference vs emulated on a tiny V4."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.prompt import render_prompt  # noqa: E402
from needlescope.dsa.stability import (  # noqa: E402
    changed_rows,
    compare_topk,
    needle_flips,
    reference_recall,
    selection_mask,
    selection_stability,
    validate_stability,
)
from needlescope.organism.config import TINY_OVERRIDES  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

TINY = TINY_OVERRIDES

REF = torch.tensor([[0, 1, 2], [3, -1, -1], [-1, -1, -1], [2, 0, 1]])
CAND = torch.tensor([[0, 1, 5], [4, -1, -1], [-1, -1, -1], [0, 1, 2]])


def test_selection_mask_drops_padding():
    m = selection_mask(torch.tensor([[2, -1], [0, 1]]), 4)
    assert m.tolist() == [[False, False, True, False], [True, True, False, False]]
    with pytest.raises(ValueError):
        selection_mask(torch.tensor([[4]]), 4)


def test_recall_of_the_reference_set():
    rec = reference_recall(REF, CAND)
    assert rec.tolist() == pytest.approx([2 / 3, 0.0, 1.0, 1.0])  # empty reference set counts as 1


def test_changed_rows_ignore_order():
    assert changed_rows(REF, CAND).tolist() == [True, True, False, False]
    assert not changed_rows(REF, REF.flip(1)).any()


def test_recall_with_a_larger_candidate_k():
    wide = torch.tensor([[0, 1, 2, 7], [9, 3, -1, -1], [5, -1, -1, -1], [0, 1, 2, 3]])
    assert reference_recall(REF, wide).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert changed_rows(REF, wide).tolist() == [True, True, True, True]


def test_needle_flips_name_entered_and_left_entries():
    flips = needle_flips(REF, CAND, needle_entries=[2, 4, 5], positions=[10, 11, 12, 13])
    assert flips == [
        {"query_pos": 10, "entered": [5], "left": [2]},
        {"query_pos": 11, "entered": [4], "left": []},
    ]
    # An entry not yet visible at a row cannot flip there.
    flips = needle_flips(
        REF, CAND, needle_entries=[2, 4, 5], positions=[10, 11, 12, 13], visible=[3, 8, 8, 8]
    )
    assert flips == [
        {"query_pos": 10, "entered": [], "left": [2]},
        {"query_pos": 11, "entered": [4], "left": []},
    ]


def test_compare_topk_drops_rows_without_visible_entries():
    positions = torch.tensor([2, 7, 11, 15])  # (t+1)//4 = 0, 2, 3, 4
    rec = compare_topk(3, positions, REF, CAND, ref_k=3, needle_entries=[2])
    assert rec["rows"] == 3 and rec["competitive_rows"] == 1  # only t=15 has more than 3 entries
    assert rec["mean_recall"] == pytest.approx((0.0 + 1.0 + 1.0) / 3)
    assert rec["mean_recall_competitive"] == pytest.approx(1.0)
    assert rec["changed_positions"] == 1 and rec["needle_flips"] == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random(tmp_path_factory.mktemp("tiny_v4_stab"), seed=1, **TINY)
    model, tok, _ = load_bundle(path)
    case = build_cases(
        CaseSpec("single", (256,), (30.0,), 1, 5), lambda m: len(render_prompt(tok, m).input_ids)
    )[0]
    return model, tok, case


def test_reference_against_itself_is_perfectly_stable(tiny):
    model, tok, case = tiny
    ref = Setting(index_topk=8)
    s = selection_stability(model, tok, case.messages, needle=case.needle, reference=ref, candidate=ref)
    validate_stability(s)
    assert [layer["layer"] for layer in s["layers"]] == [1, 3]
    for layer in s["layers"]:
        assert layer["rows"] == s["prompt_tokens"] - 3  # positions 0..2 see no entry
        assert layer["competitive_rows"] > 0
        assert layer["mean_recall"] == 1.0 and layer["min_recall"] == 1.0
        assert layer["changed_positions"] == 0 and layer["needle_flips"] == []


def test_fp4_emulation_moves_the_selection(tiny):
    model, tok, case = tiny
    s = selection_stability(
        model,
        tok,
        case.messages,
        needle=case.needle,
        reference=Setting(index_topk=8),
        candidate=Setting(index_k="fp4_e2m1", index_q="fp4_e2m1", index_topk=8),
    )
    validate_stability(s)
    assert s["candidate"]["index_k"] == "fp4_e2m1" and s["reference"]["index_k"] == "fp32"
    first = s["layers"][0]  # same inputs on both sides: differences come from the fp4 scores only
    assert first["mean_recall"] < 1.0 and first["changed_positions"] > 0
    assert s["summary"]["rows"] == sum(layer["rows"] for layer in s["layers"])
    for layer in s["layers"]:
        for f in layer["needle_flips"]:
            assert set(f["entered"] + f["left"]) <= set(s["needle_entries"])
