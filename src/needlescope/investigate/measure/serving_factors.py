"""The live route's serving-factor step (``investigate run --serving-factors``): when the live
endpoint loses recall, a bounded ``serving-factors`` experiment on the first failing length
measures which serving state reproduces the loss; ``decide.serving_factor`` decides from it.

Bounded: the symptom's kind and depths at one length, at least ``min_cases`` cases (more trials
when the symptom has fewer), the cache, batch (1 and 7 mates) and repeat factors and their cell,
plus the draft factor at depth ``DRAFT`` (and its cells) where the server takes a draft depth per
request: 6 arms and about 7 requests a case, or 10 arms and about 12 with the draft. Every send
asks ``CONTINUATION`` greedy tokens with ``ignore_eos``, so the experiment's output identity (greedy
output that departs from the baseline's more often than a repeat's) sees bugs that corrupt output
after a short answer. Its files go to ``OUT/serving_factors/``.
"""

from __future__ import annotations

import math
import shlex

__all__ = ["STEP", "measure_live_serving_factor"]

CONTINUATION = 32
"""Greedy tokens per send (``ignore_eos``): long enough for a verify pass's second step and a
stale sliding window (32 tokens on the organism) to be read."""
DRAFT = 4
"""The per-request draft depth tried (``speculative_num_draft_tokens``)."""

STEP = "measured:serving_factor"
"""The ``state.json`` step that keeps the experiment's measurements (never its decision)."""


def _command(cfg) -> str:
    """The ``needlescope serving-factors`` command that repeats the experiment of ``cfg``."""
    draft = ["--draft-depths", ",".join(map(str, cfg.draft_depths))] if cfg.draft_depths else []
    return shlex.join(
        ["needlescope", "serving-factors", "--base-url", cfg.base_urls[0], "--model", cfg.model]
        + ["--factors", ",".join(cfg.factors), "--kind", cfg.kind, "--lengths", str(cfg.lengths[0])]
        + ["--depths", ",".join(f"{d:g}" for d in cfg.depths), "--trials", str(cfg.trials)]
        + ["--seed", str(cfg.seed), "--batch-mates", "1,7", *draft]
        + ["--continuation", str(cfg.continuation), "--out", "next-serving-factors"]
    )


def _takes_draft_depth(endpoint: str, api_key: str | None) -> bool:
    """Whether the server takes a draft depth per request: ``needlescope serve`` says so by a
    ``speculative_method`` key in ``/get_server_info`` (null while its own default is no draft)."""
    from needlescope.targets.endpoints import normalize_base_url
    from needlescope.targets.provenance import collect_provenance

    root, v1 = normalize_base_url(endpoint)
    info = collect_provenance(root, v1, api_key=api_key).get("/get_server_info")
    return isinstance(info, dict) and "speculative_method" in info


def measure_live_serving_factor(session, model: str, lengths, min_cases: int = 12) -> dict | None:
    """The experiment's measurements (``decide.serving_factor.measured_factor``: its verdict,
    tests and requests, and the ``command`` that repeats it) when the run asked for it
    (``session.serving_factors``) and the route is live; else None. It runs also when the symptom
    lost nothing: the live symptom's captures run each case alone and cold, where a loss that
    needs batch mates or a warm prefix cannot show. ``lengths``: the failing lengths first.
    ``min_cases``: the experiment's size (12 pairs make a full loss p = 0.00049, below 0.05 / 6 arms).
    Kept in ``state.json`` once measured: a resumed run does not send its requests again."""
    from needlescope.investigate.decide.serving_factor import measured_factor
    from needlescope.report.serving_factors import write_serving_factors
    from needlescope.run.serving_factors import FactorConfig, run_serving_factors

    t, sy = session.ledger.target, session.ledger.symptom
    if not (session.serving_factors and t.live and t.endpoint):
        return None
    done = session.state.step_value(STEP)
    if isinstance(done, dict):
        return done
    trials = max(sy.trials, math.ceil(min_cases / len(sy.depths)))
    draft = _takes_draft_depth(t.endpoint, session.api_key)
    cfg = FactorConfig(
        (t.endpoint,),
        model,
        factors=("cache", "batch", *(("draft",) * draft), "repeat"),
        draft_depths=(DRAFT,) if draft else (),
        continuation=CONTINUATION,
        kind=sy.kind,
        lengths=(lengths[0],),
        depths=sy.depths,
        trials=trials,
        seed=sy.seed,
        batch_mates=(1, 7),
        max_tokens=max(sy.max_new_tokens, 16),
        api_key=session.api_key,
    )
    session.progress("serving factors", 0, 1, "the failing length in each serving state")
    body = run_serving_factors(cfg)
    write_serving_factors(body, session.out / "serving_factors")
    session.progress("serving factors", 1, 1, body["verdict"]["sentence"][:60])
    command = _command(cfg)
    measured = measured_factor(body, command)
    session.state.mark_done(STEP, measured)
    return measured
