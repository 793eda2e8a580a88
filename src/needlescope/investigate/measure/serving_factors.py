"""The live route's serving-factor step (``investigate run --serving-factors``): when the live
endpoint loses recall, a bounded ``serving-factors`` experiment on the first failing length
measures which serving state reproduces the loss; ``decide.serving_factor`` decides from it.

Bounded: the symptom's kind and depths at one length, at least ``min_cases`` cases (more trials
when the symptom has fewer), the cache, batch (1 and 7 mates) and repeat factors and their cell:
6 arms, about 7 requests a case. Its files go to ``OUT/serving_factors/``.
"""

from __future__ import annotations

import math
import shlex

__all__ = ["STEP", "measure_live_serving_factor"]

STEP = "measured:serving_factor"
"""The ``state.json`` step that keeps the experiment's measurements (never its decision)."""


def _command(url: str, model: str, kind: str, length: int, depths, trials: int, seed: int) -> str:
    return shlex.join(
        ["needlescope", "serving-factors", "--base-url", url, "--model", model, "--kind", kind]
        + ["--lengths", str(length), "--depths", ",".join(f"{d:g}" for d in depths)]
        + ["--trials", str(trials), "--seed", str(seed), "--batch-mates", "1,7"]
        + ["--out", "next-serving-factors"]
    )


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
    cfg = FactorConfig(
        (t.endpoint,),
        model,
        factors=("cache", "batch", "repeat"),
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
    command = _command(t.endpoint, model, sy.kind, lengths[0], sy.depths, trials, sy.seed)
    measured = measured_factor(body, command)
    session.state.mark_done(STEP, measured)
    return measured
