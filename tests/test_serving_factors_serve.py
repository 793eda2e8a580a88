"""``serving-factors`` against a real ``needlescope serve`` carrying a planted serving fault: the
experiment must name the factor the fault needs (issue 52), here ``fault:batch_variant_scores``
(the cheapest: one arm, no second server, 256-token prompts) on the shipped organism."""

from __future__ import annotations

from needlescope.run.serving_factors import FactorConfig, run_serving_factors

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
