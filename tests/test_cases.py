"""Tests for needlescope.cases."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needlescope.cases import KINDS, CaseSpec, build_cases, order_for_prefix_cache, score_answer
from needlescope.errors import BadInput


def wc(msgs):
    return sum(len(m["content"].split()) + 3 for m in msgs)


def spec(kind="single", lengths=(200, 600), depths=(0, 25, 50, 75, 100), trials=2, seed=7, **kw):
    return CaseSpec(kind, lengths, depths, trials, seed, **kw)


def joined(case):
    return "\n".join(m["content"] for m in case.messages)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(KINDS))
def test_deterministic_per_seed(seed, kind):
    a = build_cases(spec(kind, lengths=(300,), depths=(0, 50), trials=1, seed=seed), wc)
    b = build_cases(spec(kind, lengths=(300,), depths=(0, 50), trials=1, seed=seed), wc)
    assert [c.to_dict() for c in a] == [c.to_dict() for c in b]


def test_different_seeds_differ():
    a = build_cases(spec(seed=1), wc)
    b = build_cases(spec(seed=2), wc)
    assert joined(a[0]) != joined(b[0])


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_exact_length_needle_once(kind):
    cases = build_cases(spec(kind), wc)
    assert len(cases) == 2 * 5 * 2
    for c in cases:
        assert c.counted_length == c.length == wc(c.messages)
        assert joined(c).count(c.needle) == 1
        assert c.messages[-1]["role"] == "user"
        assert c.question in c.messages[-1]["content"]
        assert "Answer with the number" in c.question
        assert all(v in c.needle for v in c.expected)
        assert c.case_id == f"{kind}-L{c.length}-D{c.depth:g}-T{c.trial}"


def test_kind_specifics():
    mk = build_cases(spec("multikey", n_distractors=3), wc)[0]
    text = joined(mk)
    assert text.count("The secret code of the") == 4
    noun = mk.needle.split()[6]
    assert text.count(noun + " is ") == 4
    mv = build_cases(spec("multivalue", n_values=4), wc)[0]
    assert len(mv.expected) == 4 and len(set(mv.expected)) == 4
    mt = build_cases(spec("multiturn", lengths=(1500,)), wc)[0]
    roles = [m["role"] for m in mt.messages]
    assert len(roles) >= 5 and roles[0] == "user" and roles[1] == "assistant"
    assert mt.needle in mt.messages[0]["content"]  # depth 0 -> first user turn


@pytest.mark.parametrize("kind", KINDS)
def test_depth_position_monotone(kind):
    cases = build_cases(spec(kind, lengths=(800,), depths=(0, 10, 30, 50, 70, 90, 100), trials=1), wc)
    positions = [joined(c).index(c.needle) for c in cases]
    assert positions == sorted(positions)
    assert positions[0] < positions[-1]


def test_same_group_shares_filler_prefix():
    cases = build_cases(spec(lengths=(600,), depths=(20, 80), trials=1), wc)
    a, b = (joined(c) for c in cases)
    cut = a.index(cases[0].needle)
    assert a[:cut] == b[:cut] and cases[0].group == cases[1].group


def test_too_short_raises():
    with pytest.raises(
        BadInput,
        match=r"length 10 is shorter than the needle and question \(\d+ tokens\); use lengths >= \d+",
    ):
        build_cases(spec(lengths=(10, 500)), wc)


@pytest.mark.parametrize(
    "kw", [{"kind": "bogus"}, {"lengths": ()}, {"depths": (101,)}, {"trials": 0}, {"lengths": (5, 5)}]
)
def test_bad_spec(kw):
    with pytest.raises(BadInput):
        spec(**kw)


def test_unknown_kind_names_allowed_values():
    with pytest.raises(BadInput, match="single, multikey, multivalue, multiturn"):
        spec(kind="nope")


def test_user_haystack_text():
    cases = build_cases(spec(haystack_text="Once upon a time there was a fox. It ran far away"), wc)
    for c in cases:
        assert c.counted_length == c.length
        assert "fox" in joined(c)


def test_a_count_that_stops_growing_is_refused_not_searched_forever():
    """A counter that grows with the first words and then stops (a template that keeps only the
    start of a message, a server that truncates) never reaches the length: the filler search
    gives up with one message instead of doubling the filler without end."""

    def capped(msgs):
        return min(wc(msgs), 150)

    with pytest.raises(BadInput, match="does not grow with the text"):
        build_cases(spec(lengths=(600,), depths=(50,), trials=1), capped)


def test_closest_when_exact_impossible():
    # A counter with only even counts cannot hit an odd target; expect the closest instead.
    def even(msgs):
        return 2 * wc(msgs)

    c = build_cases(spec(lengths=(601,), depths=(50,), trials=1), even)[0]
    assert abs(c.counted_length - 601) == 1


def test_order_for_prefix_cache():
    cases = build_cases(spec(), wc)
    ordered = order_for_prefix_cache(cases)
    assert sorted(c.case_id for c in ordered) == sorted(c.case_id for c in cases)
    groups = [c.group for c in ordered]
    seen = []
    for g in groups:
        if not seen or seen[-1] != g:
            assert g not in seen
            seen.append(g)
    for g in seen:
        ds = [c.depth for c in ordered if c.group == g]
        assert ds == sorted(ds, reverse=True)


@pytest.mark.parametrize(
    "answer,expected,ok",
    [
        ("1234567", ["1234567"], True),
        ("The code is 1234567.", ["1234567"], True),
        ("  THE CODE:  **1234567**  ", ["1234567"], True),
        ("91234567", ["1234567"], False),
        ("123 4567", ["1234567"], False),
        ("111, 222 and 333", ["111", "222", "333"], True),
        ("111, 222", ["111", "222", "333"], False),
        ("the Blue  Falcon!", ["blue falcon"], True),
        ("", ["1"], False),
    ],
)
def test_score_answer(answer, expected, ok):
    assert score_answer(answer, expected) is ok
