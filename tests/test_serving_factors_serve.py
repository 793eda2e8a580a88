"""``serving-factors`` against a real ``needlescope serve`` carrying a planted serving fault: the
experiment must name the factor the fault needs (issue 52), here ``fault:batch_variant_scores``
(the cheapest: one arm, no second server, 256-token prompts) on the shipped organism.

Not cheap enough for ``make test``: 15 cases are the fewest that name the batch reliably (the
fault leaves about a third of the answers right beside 7 mates, so 8 cases give p near 0.05),
which is 30 organism requests and a server of its own: 21 s on the 2-core box at load 6 to 11,
161 s at load 30. It runs with ``NEEDLESCOPE_SERVE_FAULTS=1`` (docs/serving_factors.md)."""

from __future__ import annotations

import os

import pytest

from needlescope.run.serving_factors import FactorConfig, run_serving_factors

pytestmark = pytest.mark.skipif(
    os.environ.get("NEEDLESCOPE_SERVE_FAULTS") != "1",
    reason="a real organism server and 30 requests (minutes on 2 cores): NEEDLESCOPE_SERVE_FAULTS=1 runs it",
)

# top-16 at 256 tokens: the indexer drops entries, where the batch-variant scorer costs recall.
FAULTY = ("--threads", "1", "--index-topk", "16", "--patch", "fault:batch_variant_scores")


def test_serve_batch_variant_fault_is_named_batch(organism_server):
    url = organism_server(*FAULTY)
    cfg = FactorConfig(
        (url + "/v1",),
        "organism",
        factors=("batch",),
        batch_mates=(7,),
        lengths=(256,),
        depths=(0.0, 25.0, 50.0, 75.0, 100.0),
        trials=3,
        max_tokens=6,
    )
    body = run_serving_factors(cfg)
    verdict, (test,) = body["verdict"], body["tests"]
    assert verdict["named"] == "batch", verdict["sentence"]
    assert test["arm"] == "batch=beside7" and test["p_holm"] < 0.05 and test["lost"] > test["gained"]
    batch = next(a for a in body["arms"] if a["name"] == "batch=beside7")
    assert batch["batch_size_mean"] > 1  # the server said the sends met in a batch
    assert body["requests"]["sent"] <= 32
