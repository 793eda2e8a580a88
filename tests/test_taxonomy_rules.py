"""The failure taxonomy's rules (pure): each class and its evidence, the order the classes are
checked in, the source of a cross-case answer, and the failure summary's counts and chance test.
Every expectation is worked out by hand from the module docstring's rules."""

from __future__ import annotations

import math

import pytest

from needlescope.analysis.taxonomy import (
    CLASSES,
    CaseIndex,
    Failure,
    classify,
    edit_distance,
    prompt_values,
    sent_at,
    summarize_failures,
)

GOLD = ["4173559"]


def test_edit_distance_textbook_values():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == edit_distance("abc", "") == 3
    assert edit_distance("ab", "ba") == 2 and edit_distance("same", "same") == 0
    assert edit_distance("4173559", "41735590") == 1  # one insertion


def test_no_answer_or_a_cut_off_answer():
    f = classify(answer=None, expected=GOLD, finish_reason="length", reasoning="  ab ")
    assert f == Failure("reasoning_exhausted", detail={"reasoning_chars": 5})
    assert classify(answer=" ", expected=GOLD, finish_reason="length", reasoning="   ").category == (
        "empty_or_length"
    )
    assert classify(answer="", expected=GOLD, finish_reason="stop").detail == {"finish_reason": "stop"}
    cut = classify(answer="4173559", expected=GOLD, finish_reason="length", reasoning="x")
    assert cut == Failure("empty_or_length", detail={"finish_reason": "length"})


def test_prompt_values_and_the_distractor_depth():
    # "ab 12" and "x 34", each counted with one separator: 11 characters; "12" at 3, "34" at 6 + 2
    messages = [{"role": "system", "content": "ab 12"}, {"role": "user", "content": "x 34"}]
    (v1, d1), (v2, d2) = prompt_values(messages)
    assert (v1, v2) == ("12", "34") and d1 == pytest.approx(300 / 11) and d2 == pytest.approx(800 / 11)
    assert prompt_values([{"content": None}]) == []
    f = classify(answer="It is 34.", expected=["99"], messages=messages)
    assert f == Failure("distractor", value="34", distractor_depth=72.73)
    # a value stated twice stands where it is first stated
    twice = classify(answer="7", expected=["9"], messages=[{"content": "7 and 7"}])
    assert twice.distractor_depth == 0.0


def test_cross_case_comes_before_near_miss():
    other = {"source_case": "x", "sent_before_s": 1.0, "same_connection": True}
    f = classify(answer="4173558", expected=GOLD, other_case=lambda v: other if v == "4173558" else None)
    assert f == Failure("cross_case", value="4173558", detail=other)
    assert classify(answer="4173558", expected=GOLD, other_case=lambda v: None).category == "near_miss"


def test_near_miss_partial_and_their_positions():
    assert classify(answer="4173558", expected=[" 4173559 "]) == Failure(
        "near_miss", value="4173558", edit_distance=1, first_wrong=6
    )
    assert classify(answer="4173500", expected=GOLD) == Failure(
        "near_miss", value="4173500", edit_distance=2, first_wrong=5
    )
    # a longer value that only adds a digit: wrong from the position where the gold one ends
    assert classify(answer="41735590", expected=GOLD).first_wrong == 7
    # the second expected value is the close one
    assert classify(answer="4173550", expected=["111", "4173559"]).category == "near_miss"
    # three edits: a partial when the first digit is right
    assert classify(answer="4173000", expected=GOLD) == Failure(
        "partial", value="4173000", edit_distance=3, first_wrong=4
    )
    assert classify(answer="417", expected=GOLD) == Failure(
        "partial", value="417", edit_distance=4, first_wrong=3
    )
    # wrong from the first digit: not partial
    assert classify(answer="5173000", expected=GOLD).category == "unrelated"
    assert classify(answer="Sorry, 5173000", expected=GOLD).category == "refusal"
    some = classify(answer="111 and 999", expected=["111", "222"])
    assert some == Failure("partial", detail={"values_found": 1, "values_expected": 2})


@pytest.mark.parametrize(
    "text",
    ["I don't know", "dont know", "It is not mentioned.", "I cannot tell", "couldn't find it", "SORRY",
     "unknown", "There is no code", "The code isn't stated"],
)  # fmt: skip
def test_refusals(text):
    assert classify(answer=text, expected=GOLD).category == "refusal"


def test_unrelated_and_the_record():
    f = classify(answer="The sky is blue.", expected=GOLD)
    assert f == Failure("unrelated") and f.to_dict() == {"category": "unrelated"}
    d = Failure("near_miss", value="1", edit_distance=1, first_wrong=0).to_dict()
    assert d == {"category": "near_miss", "value": "1", "edit_distance": 1, "first_wrong": 0}
    assert set(CLASSES) == {
        "distractor", "cross_case", "near_miss", "partial", "refusal", "empty_or_length",
        "reasoning_exhausted", "unrelated",
    }  # fmt: skip


def test_sent_at():
    assert sent_at({"finished_at": 10, "latency_s": 2.5}) == 7.5
    assert sent_at({"finished_at": 10}) is None and sent_at({"latency_s": 1.0}) is None


def _row(cid, expected, sent, conn):
    return {
        "case_id": cid,
        "expected": expected,
        "finished_at": sent + 1.0,
        "latency_s": 1.0,
        "connection": conn,
    }


def test_the_source_of_a_cross_case_answer_is_the_latest_case_sent_before_it():
    rows = [_row("a", ["111"], 10.0, "c1"), _row("b", ["111"], 12.0, "c2"), _row("c", ["222"], 13.0, "c1"),
            _row("d", ["333"], 20.0, None), _row("e", ["444"], 5.0, "c1")]  # fmt: skip
    index = CaseIndex(rows)
    assert index.source(rows[2], "111") == {
        "source_case": "b",
        "sent_before_s": 1.0,
        "same_connection": False,
    }
    # Nothing expecting 333 was sent before e: the first case after it, at a negative lag.
    assert index.source(rows[4], "333") == {
        "source_case": "d",
        "sent_before_s": -15.0,
        "same_connection": None,
    }
    assert index.source(rows[2], "999") is None
    fail = classify(
        answer="The code is 111.", expected=["222"], other_case=lambda v: index.source(rows[2], v)
    )
    assert fail.category == "cross_case" and fail.value == "111" and fail.detail["source_case"] == "b"
    # A value the prompt states is a distractor first; without an index nothing is cross-case.
    stated = [{"role": "user", "content": "The other code is 111. What is the code?"}]
    lookup = lambda v: index.source(rows[2], v)  # noqa: E731
    assert (
        classify(answer="111", expected=["222"], messages=stated, other_case=lookup).category == "distractor"
    )
    assert classify(answer="111", expected=["222"]).category == "unrelated"


def test_case_index_ties_own_case_and_unknown_times():
    rows = [_row("x", ["5"], 10.0, "c1"), _row("y0", ["7"], 5.0, "c1"), _row("y1", ["7"], 10.0, "c1"),
            _row("dup", [" 8 ", "8"], 1.0, "c1"), _row("self", ["8"], 0.5, "c1")]  # fmt: skip
    index = CaseIndex(rows)
    # sent at the same moment counts as before, and is later than y0
    assert index.source(rows[0], "7") == {"source_case": "y1", "sent_before_s": 0.0, "same_connection": True}
    # a case is never its own source, and a value listed twice is one entry
    assert (
        index.source(rows[4], "8")["source_case"] == "dup"
        and index.source(rows[3], "8")["source_case"] == "self"
    )
    assert len(CaseIndex(rows[3:4])._by_value["8"]) == 1
    # no send times: the first case that expects the value, no lag
    untimed = CaseIndex([{"case_id": "p", "expected": ["9"]}, {"case_id": "q", "expected": ["9"]}])
    assert untimed.source({"case_id": "r", "connection": "c"}, "9") == {
        "source_case": "p", "sent_before_s": None, "same_connection": None,
    }  # fmt: skip
    # lags are rounded to the millisecond: t went at 3.0 - 0.7654, the asking row at 4.0
    odd = CaseIndex([{**_row("t", ["6"], 2.0, "c1"), "latency_s": 0.7654}])
    assert odd.source(_row("s", ["6"], 4.0, "c1"), "6")["sent_before_s"] == 1.765


def _miss(cid, answer, expected, category, **fail):
    return {"status": "ok", "correct": False, "case_id": cid, "answer": answer, "expected": expected,
            "length": 100, "depth": 50.0, "failure": {"category": category, **fail}}  # fmt: skip


def test_summary_counts_examples_and_errors():
    rows = [_miss(f"n{i}", "9" * 250, ["1"], "near_miss", value="2", detail={"k": i}) for i in range(4)]
    rows += [
        {"status": "error", "case_id": "e", "failure": {"category": "refusal"}},
        {"status": "ok", "correct": True, "case_id": "c", "failure": {"category": "refusal"}},
        {"status": "ok", "correct": False, "case_id": "u"},  # a miss not yet classified
    ]
    s = summarize_failures(rows)
    assert (s["misses"], s["errors"]) == (4, 1)
    assert s["counts"] == {**dict.fromkeys(CLASSES, 0), "near_miss": 4}
    assert list(s["examples"]) == ["near_miss"] and len(s["examples"]["near_miss"]) == 3
    assert s["examples"]["near_miss"][1] == {
        "case_id": "n1", "length": 100, "depth": 50.0, "expected": ["1"], "answer": "9" * 200, "value": "2", "k": 1,
    }  # fmt: skip
    assert len(summarize_failures(rows, examples_per_class=1)["examples"]["near_miss"]) == 1


def test_cross_case_count_against_chance():
    def cross(cid, answer, expected, lag, same):
        return _miss(cid, answer, expected, "cross_case", value=answer,
                     detail={"source_case": "s" + cid, "sent_before_s": lag, "same_connection": same})  # fmt: skip

    rows = [
        cross("a", "222", ["111"], 1.5, True),
        cross("b", "111", [" 222"], 2.5, False),
        _miss("c", "44", ["333"], "near_miss"),  # two digits: not a wrong 3-digit value
        _miss("d", "The 555 and 444", ["444"], "unrelated"),  # 555: one more wrong value
        {
            "status": "error",
            "case_id": "e",
            "answer": "999",
            "expected": ["222"],
            "failure": {"category": "x"},
        },
    ]
    cc = summarize_failures(rows)["cross_case"]
    chance = 3 / 1000  # four distinct values ("222" counted once): three other cases' values of 3 digits
    p = 3 * chance**2 * (1 - chance) + chance**3  # two or more of three wrong values by luck
    assert cc["wrong_values"] == 3 and cc["chance"] == pytest.approx(chance)
    assert cc["p_value"] == pytest.approx(p) and cc["significant"]
    assert (cc["count"], cc["same_connection"], cc["other_connection"], cc["connection_unknown"]) == (
        2,
        1,
        1,
        0,
    )
    assert (cc["sources"], cc["sent_before_s_median"]) == (2, 2.0)
    one = summarize_failures(rows[:1] + rows[2:])["cross_case"]  # p = 1 - 0.997^2 < 0.01, but one alone
    assert one["p_value"] == pytest.approx(1 - (1 - chance) ** 2) and not one["significant"]
    assert summarize_failures([])["cross_case"]["chance"] == 0.0
    # no expected values anywhere: a one-digit wrong answer still counts, at zero chance
    bare = summarize_failures([_miss("z", "5", [], "unrelated")])["cross_case"]
    assert (bare["wrong_values"], bare["chance"], bare["sent_before_s_median"]) == (1, 0.0, None)
    # 110 two-digit-or-shorter values: 109 / 100 others by luck, capped at certainty
    many = [
        {"status": "ok", "correct": True, "expected": [v]}
        for v in [f"{i:02d}" for i in range(100)] + [str(i) for i in range(10)]
    ]
    assert summarize_failures(many)["cross_case"]["chance"] == 1.0
    assert math.isclose(summarize_failures(many[:11])["cross_case"]["chance"], 10 / 100)


def test_edges_of_each_rule():
    assert edit_distance("abc", "ac") == edit_distance("4173559", "417359") == 1  # one deletion
    assert classify(answer=None, expected=GOLD, finish_reason="length").category == "empty_or_length"
    # right first digit, then five wrong ones: a partial from position 1
    assert classify(answer="4999999", expected=GOLD) == Failure(
        "partial", value="4999999", edit_distance=5, first_wrong=1
    )
    # an empty message still counts its separator; the third message starts after both before it
    ((_, depth),) = prompt_values([{"content": None}, {"content": "5"}])
    assert depth == pytest.approx(100 / 3)
    ((_, depth),) = prompt_values([{"content": "ab"}, {"content": "cd"}, {"content": "7"}])
    assert depth == pytest.approx(600 / 8)


def test_case_index_edges():
    # nothing sent before: the earliest of those sent after, whatever the order of the rows
    late = CaseIndex(
        [_row("f", ["5"], 30.0, "c"), _row("g", ["5"], 25.0, "c"), {"case_id": "u", "expected": ["6"]}]
    )
    assert late.source(_row("x", ["1"], 20.0, "c"), "5")["source_case"] == "g"
    # a source without a send time: no lag, even when the asking row has one
    assert late.source(_row("x", ["1"], 20.0, "c"), "6") == {
        "source_case": "u", "sent_before_s": None, "same_connection": None,
    }  # fmt: skip
    mixed = CaseIndex([{"case_id": "u", "expected": ["6"]}, _row("t", ["6"], 1.0, "c")])
    assert mixed.source(_row("x", ["1"], 20.0, "c"), "6")["source_case"] == "t"


def test_summary_edges():
    rows = [{"status": "error", "case_id": "e1"}, {"status": "error", "case_id": "e2"},
            _miss("n", None, ["1"], "unrelated")]  # fmt: skip
    s = summarize_failures(rows)
    assert s["errors"] == 2 and s["examples"]["unrelated"][0]["answer"] == ""

    def cross(cid, same):
        return _miss(cid, "222", ["111"], "cross_case", detail={"source_case": "s", "same_connection": same})

    cc = summarize_failures([cross("a", True), cross("b", True), cross("c", None)])["cross_case"]
    assert (cc["same_connection"], cc["other_connection"], cc["connection_unknown"]) == (2, 0, 1)
