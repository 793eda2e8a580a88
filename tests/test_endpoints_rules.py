"""Recall by endpoint and replica (pure): which are worse than the rest, and the replica note.
The p-values are worked out from the hypergeometric distribution by hand."""

from __future__ import annotations

import math

import pytest

from needlescope.analysis.endpoints import check_same_models, endpoint_breakdown
from needlescope.errors import BadInput


def _rows(url, right, wrong, replica=None):
    extra = {"replica": replica} if replica else {}
    return [{"status": "ok", "base_url": url, "correct": True, **extra}] * right + [
        {"status": "ok", "base_url": url, "correct": False, **extra}
    ] * wrong


def test_the_worse_endpoint_differs_and_the_better_one_does_not():
    rows = _rows("http://a", 20, 0) + _rows("http://b", 0, 20)
    rows += [{"status": "error", "base_url": "http://b", "correct": True}, {"status": "ok", "correct": False}]
    out = endpoint_breakdown(rows)
    a, b = out["endpoints"]
    # 20 right of 40 split 20 / 0: one table of C(40, 20) each way, both tails
    p = 2 / math.comb(40, 20)
    assert (b["name"], b["n"], b["correct"], b["recall"], b["rest_recall"]) == ("http://b", 20, 0, 0.0, 1.0)
    assert (a["recall"], a["rest_recall"]) == (1.0, 0.0)
    # Holm over the two groups: the smaller of two equal p-values times 2, the other no smaller
    assert b["p_value"] == pytest.approx(p) and a["p_holm"] == b["p_holm"] == pytest.approx(2 * p)
    assert out["differs"] == ["http://b"] and out["replicas"] == []
    assert out["replica_note"] == (
        "the responses name no replica; behind a router, per-replica attribution needs each "
        "replica's URL as its own --base-url"
    )
    assert endpoint_breakdown(rows, alpha=1.5 * p)["differs"] == []  # p < alpha, p_holm not
    assert endpoint_breakdown(rows, alpha=b["p_holm"])["differs"] == []  # significant means below alpha


def test_a_difference_the_cases_cannot_confirm_is_not_named():
    # 5/5 against 4/5: p = 1, however worse b looks
    out = endpoint_breakdown(_rows("http://a", 5, 0) + _rows("http://b", 4, 1))
    assert out["endpoints"][1]["p_holm"] == pytest.approx(1.0) and out["differs"] == []
    # one endpoint: no rest to compare with
    solo = endpoint_breakdown(_rows("http://a", 0, 9))
    assert solo["endpoints"][0]["rest_recall"] is None and solo["differs"] == []


def test_replicas_are_tested_like_endpoints():
    rows = _rows("http://lb", 12, 0, replica="r1") + _rows("http://lb", 0, 12, replica="r2")
    out = endpoint_breakdown(rows)
    assert [r["name"] for r in out["replicas"]] == ["r1", "r2"] and out["differs"] == ["r2"]
    assert out["replica_note"] == "2 replica(s) named by the responses (X-Replica-Id or similar)"
    assert [e["name"] for e in out["endpoints"]] == ["http://lb"]


def test_check_same_models():
    check_same_models({})
    check_same_models({"http://a": ["m", "n"], "http://b": ["n", "m"]})
    with pytest.raises(
        BadInput, match=r"http://b serves \(nothing\) but http://a serves m; every --base-url"
    ):
        check_same_models({"http://a": ["m"], "http://b": []})
    with pytest.raises(BadInput, match=r"http://c serves x but http://a serves \(nothing\)"):
        check_same_models({"http://a": [], "http://b": [], "http://c": ["x"]})
    with pytest.raises(BadInput, match=r"http://b serves m but http://a serves m, x;"):
        check_same_models({"http://a": ["x", "m"], "http://b": ["m"]})
