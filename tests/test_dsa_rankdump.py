"""Rank dump: pure rank/margin math on hand-made rows, and dumps of a tiny random DeepSeek-V4."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.emulate import IndexerCapture, emulate  # noqa: E402
from needlescope.dsa.prompt import covering_entries, needle_token_span, render_prompt  # noqa: E402
from needlescope.dsa.rankdump import (  # noqa: E402
    answer_positions,
    combine_dumps,
    needle_rank_stats,
    plot_margin_vs_length,
    plot_rank_vs_layer,
    rank_dump,
    render_rankdump_md,
    selected_in,
    validate_rankdump,
)
from needlescope.dsa.reference import topk_indices  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.organism.config import TINY_OVERRIDES  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

TINY = TINY_OVERRIDES


# ---------------------------------------------------------------- pure math on hand-made rows


def test_rank_cutoff_margin_on_a_hand_made_row():
    row = [0.1, 0.9, 0.5, 0.7, 0.3]
    # Entry 5 is not visible: its huge score must be ignored.
    scores = torch.tensor(row + [50.0, float("-inf")])
    st2 = needle_rank_stats(scores, visible=5, needle_entries=[2], k=2)
    ordered = sorted(row, reverse=True)
    assert st2.best_entry == 2 and st2.needle_score == pytest.approx(row[2])
    assert st2.best_rank == 1 + sum(v >= row[2] for i, v in enumerate(row) if i != 2)
    assert st2.cutoff_score == pytest.approx(ordered[1])
    assert st2.margin == pytest.approx(row[2] - ordered[1])
    assert st2.margin_frac == pytest.approx((row[2] - ordered[1]) / (max(row) - min(row)))
    assert not st2.within_k
    st3 = needle_rank_stats(scores, visible=5, needle_entries=[2], k=3)
    assert st3.cutoff_score == pytest.approx(row[2]) and st3.margin == 0.0 and st3.within_k


def test_best_needle_entry_is_the_highest_scoring_one():
    scores = torch.tensor([0.2, 0.8, 0.4, 0.6])
    st = needle_rank_stats(scores, visible=4, needle_entries=[0, 2, 3], k=1)
    assert st.best_entry == 3 and st.best_rank == 2 and st.needle_score == pytest.approx(0.6)


def test_ties_are_counted_pessimistically():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0])
    st = needle_rank_stats(scores, visible=4, needle_entries=[1], k=2)
    assert st.best_rank == 3 and st.ties == 2
    assert st.best_rank - st.ties == 1  # optimistic rank
    assert not st.within_k  # not guaranteed: a tie-break may drop it


def test_visible_at_most_k_selects_everything():
    scores = torch.tensor([0.3, -0.2, 0.9])
    st = needle_rank_stats(scores, visible=3, needle_entries=[1], k=8)
    assert st.k == 3 and st.cutoff_score == pytest.approx(-0.2)
    assert st.within_k and st.margin == 0.0 and st.best_rank == 3


def test_flat_row_has_zero_margin_fraction():
    st = needle_rank_stats(torch.zeros(6), visible=6, needle_entries=[4], k=2)
    assert st.margin == 0.0 and st.margin_frac == 0.0


@pytest.mark.parametrize(
    "visible,needles,k",
    [(0, [0], 1), (4, [], 1), (4, [4], 1), (4, [-1], 1), (4, [1], 0), (9, [1], 1)],
)
def test_rank_stats_rejects_inconsistent_input(visible, needles, k):
    with pytest.raises(ValueError):
        needle_rank_stats(torch.arange(8.0), visible, needles, k)


def test_rank_stats_rejects_non_finite_visible_scores():
    with pytest.raises(ValueError, match="non-finite"):
        needle_rank_stats(torch.tensor([0.0, float("nan"), 1.0]), 3, [0], 1)


def test_selected_in_ignores_padding():
    row = torch.tensor([4, 7, -1, -1])
    assert selected_in(row, [7, 9]) and not selected_in(row, [1, 2])
    assert not selected_in(torch.full((3,), -1), [0])


def test_answer_positions_are_the_fed_positions():
    assert answer_positions(100, 1) == [99]
    assert answer_positions(100, 4) == [99, 100, 101, 102]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    visible=st.integers(1, 40),
    k1=st.integers(1, 48),
    dk=st.integers(0, 16),
    quantized=st.booleans(),
)
def test_rank_stats_agree_with_reference_topk_and_grow_with_k(seed, visible, k1, dk, quantized):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(visible + 3, generator=g)
    if quantized:  # coarse grid: many exact ties
        scores = (scores * 2).round() / 2
    n = 1 + int(torch.randint(0, min(3, visible), (1,), generator=g))
    needles = torch.randperm(visible, generator=g)[:n].tolist()
    prev = None
    for k in (k1, k1 + dk):
        stt = needle_rank_stats(scores, visible, needles, k)
        sel = selected_in(topk_indices(scores.view(1, -1), k, torch.tensor([visible]))[0], needles)
        assert 1 <= stt.best_rank <= visible
        if stt.within_k:
            assert sel  # pessimistic rank within k: selected whatever the tie-break
        if sel:
            assert stt.best_rank - stt.ties <= stt.k
        if prev is not None:  # larger k: lower (or equal) cutoff, never unselects
            assert stt.cutoff_score <= prev.cutoff_score
            assert stt.margin >= prev.margin
            assert stt.within_k or not prev.within_k
            assert stt.best_rank == prev.best_rank
        prev = stt


# ---------------------------------------------------------------- tiny random DeepSeek-V4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random(tmp_path_factory.mktemp("tiny_v4"), seed=0, **TINY)
    model, tok, _ = load_bundle(path)

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    case = build_cases(CaseSpec("single", (256,), (40.0,), 1, 3), count)[0]
    return model, tok, case


@pytest.fixture(scope="module")
def explicit_dumps(tiny):
    """Prefill dumps at every 5th position after the needle, for several index_topk."""
    model, tok, case = tiny
    prompt = render_prompt(tok, case.messages)
    _, end = needle_token_span(prompt, case.needle)
    positions = list(range(end + 4, len(prompt.input_ids), 5))
    out = {}
    for k in (2, 6, 16, 1024):
        out[k] = rank_dump(
            model,
            tok,
            case.messages,
            needle=case.needle,
            setting=Setting(index_topk=k),
            query_positions=positions,
        )
    return positions, out


def test_dump_follows_the_schema_and_covers_every_csa_layer(tiny, explicit_dumps):
    model, tok, case = tiny
    positions, dumps = explicit_dumps
    for k, d in dumps.items():
        validate_rankdump(d)
        assert d["index_topk"] == k and d["query_positions_source"] == "explicit"
        assert [layer["layer"] for layer in d["layers"]] == [1, 3]  # the organism's CSA layers
        span = tuple(d["needle_token_span"])
        for layer in d["layers"]:
            assert [p["query_pos"] for p in layer["positions"]] + layer["needle_not_visible"] == positions
            for p in layer["positions"]:
                assert p["visible_entries"] == (p["query_pos"] + 1) // 4
                assert p["needle_entries"] == [e for e in covering_entries(span) if e < p["visible_entries"]]


def test_selected_matches_the_captured_topk(tiny, explicit_dumps):
    model, tok, case = tiny
    positions, dumps = explicit_dumps
    d = dumps[6]
    capture = IndexerCapture()
    ids = torch.tensor([render_prompt(tok, case.messages).input_ids])
    with torch.no_grad(), emulate(model, Setting(index_topk=6), capture=capture):
        model(ids, use_cache=False)
    seen = 0
    for layer in d["layers"]:
        pos, topk = capture.rows(layer["layer"], width=6)
        row = {int(t): i for i, t in enumerate(pos.tolist())}
        for p in layer["positions"]:
            sel = selected_in(topk[row[p["query_pos"]]], p["needle_entries"])
            assert p["selected"] == sel
            # Rank and selection agree up to ties (pessimistic rank within k => selected).
            if p["best_rank"] <= 6:
                assert p["selected"]
            if p["selected"]:
                assert p["best_rank"] - p["ties"] <= 6
            seen += 1
    assert seen >= 2 * len(positions) - 4
    # With k = 6 some positions must compete (visible > k) and some needle must miss the cut.
    assert any(not p["selected"] for layer in d["layers"] for p in layer["positions"])


def test_k_at_least_visible_always_selects(explicit_dumps):
    _, dumps = explicit_dumps
    for layer in dumps[1024]["layers"]:
        for p in layer["positions"]:
            assert p["visible_entries"] <= 1024
            assert p["selected"] and p["margin"] >= 0.0


def test_larger_k_never_unselects_in_the_first_csa_layer(explicit_dumps):
    # The first CSA layer's scores do not depend on k (later layers do: k changes attention).
    _, dumps = explicit_dumps
    ks = sorted(dumps)
    first = {k: dumps[k]["layers"][0]["positions"] for k in ks}
    for lo, hi in zip(ks, ks[1:]):
        for a, b in zip(first[lo], first[hi], strict=True):
            assert a["best_rank"] == b["best_rank"] and a["needle_score"] == b["needle_score"]
            assert b["cutoff_score"] <= a["cutoff_score"]
            assert b["selected"] or not a["selected"]


def test_answer_positions_dump_generates_and_scores(tiny):
    model, tok, case = tiny
    d = rank_dump(
        model,
        tok,
        case.messages,
        needle=case.needle,
        setting=Setting(index_k="fp4_e2m1", index_q="fp4_e2m1", index_topk=8),
        max_new_tokens=3,
        expected=case.expected,
        label="tiny",
    )
    validate_rankdump(d)
    P, n = d["prompt_tokens"], len(d["generated_tokens"])
    assert 1 <= n <= 3 and isinstance(d["answer_correct"], bool)
    assert d["numerics"] == {
        "index_k": "fp4_e2m1",
        "index_q": "fp4_e2m1",
        "score_dtype": "fp32",
        "hadamard": True,
    }
    for layer in d["layers"]:
        got = [p["query_pos"] for p in layer["positions"]] + layer["needle_not_visible"]
        assert sorted(got) == answer_positions(P, n)


def test_markdown_plots_and_multi_prompt_dump(tiny, explicit_dumps, tmp_path):
    _, dumps = explicit_dumps
    a = {**dumps[6], "label": "short"}
    b = {**dumps[16], "label": "other", "index_topk": 6}
    multi = combine_dumps([a, b])
    validate_rankdump(multi)
    assert multi["prompt_tokens"] == a["prompt_tokens"] and len(multi["prompts"]) == 2
    md = render_rankdump_md(multi)
    assert "## short" in md and "## other" in md and md.count("\n| 1 |") == 2
    plot_rank_vs_layer(multi, tmp_path / "rank.png")
    plot_margin_vs_length(multi, tmp_path / "margin.png")
    for name in ("rank.png", "margin.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_validate_rankdump_rejects_bad_objects(explicit_dumps):
    _, dumps = explicit_dumps
    d = dumps[6]
    with pytest.raises(ValueError, match="missing key"):
        validate_rankdump({k: v for k, v in d.items() if k != "layers"})
    bad = {**d, "index_topk": True}
    with pytest.raises(ValueError, match="index_topk"):
        validate_rankdump(bad)
    layer = {**d["layers"][0], "positions": [{**d["layers"][0]["positions"][0], "best_rank": 0}]}
    with pytest.raises(ValueError, match="best_rank"):
        validate_rankdump({**d, "layers": [layer]})
    layer = {**d["layers"][0], "positions": [{**d["layers"][0]["positions"][0], "selected": 1}]}
    with pytest.raises(ValueError, match="selected"):
        validate_rankdump({**d, "layers": [layer]})


def test_bad_needles_and_positions_are_bad_input(tiny):
    model, tok, case = tiny
    with pytest.raises(BadInput, match="not found"):
        rank_dump(model, tok, case.messages, needle="a sentence that is not there", query_positions=[10])
    with pytest.raises(BadInput, match="span"):
        rank_dump(model, tok, case.messages, needle_span=(5, 100_000), query_positions=[10])
    with pytest.raises(BadInput, match="query positions"):
        rank_dump(model, tok, case.messages, needle=case.needle, query_positions=[100_000])
    with pytest.raises(BadInput, match="needle"):
        rank_dump(model, tok, case.messages, query_positions=[10])


def test_margin_fraction_is_bounded(explicit_dumps):
    _, dumps = explicit_dumps
    for d in dumps.values():
        for layer in d["layers"]:
            for p in layer["positions"]:
                assert -1.0 - 1e-9 <= p["margin_frac"] <= 1.0 + 1e-9
                assert math.isfinite(p["margin"])
