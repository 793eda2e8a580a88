"""Which serving factor reproduces a live loss: a ``serving-factors`` experiment's verdict
(``run.serving_factors``, docs/serving_factors.md) merged into the characterization. Pure.

When the experiment names a factor (or two, an interaction), the loss depends on the serving
state: the class is ``state_dependent`` (first), its evidence gives the factor in the
investigation's words (``FACTOR_WORDS``: prefix cache, batch, speculative, chunking, repeat) with
the experiment's numbers, the summary line says it, and ``next`` is the command that shows it.
When recall names none but the experiment's **output identity** names a factor (greedy output
departs from the baseline's in one serving state more often than the same request sent again:
``analysis.factors.decide_identity``), the class is ``state_dependent`` too, with the output
evidence (``effect``: ``output departs``); its words never call it a recall loss. When neither
names one, the characterization is kept and the experiment (its power) is noted under
``measured``; docs/signatures.md maps each factor to the public bug classes it points at.
"""

from __future__ import annotations

__all__ = ["FACTOR_WORDS", "measured_factor", "with_serving_factor"]

FACTOR_WORDS = {
    "cache": "prefix cache",
    "batch": "batch",
    "draft": "speculative",
    "chunk": "chunking",
    "repeat": "repeat",
    "endpoint": "a launch flag",
}

_HINT = {
    "cache": "state restored on a prefix hit (a stale sliding-window ring, a kept state that is not the cold one)",
    "batch": "batch-variant numerics, or rows of one batch reaching another's",
    "draft": "a speculative verify pass that keeps too little state for its draft",
    "chunk": "state carried across a prefill-chunk boundary",
    "repeat": "state kept across requests (a cache slot or buffer never reset)",
    "endpoint": "the launch flag the two endpoints differ in",
}


def _words(named: str) -> str:
    return " × ".join(FACTOR_WORDS.get(f, f) for f in named.split(" × "))


def measured_factor(body: dict, command: str) -> dict:
    """What the investigation keeps of a serving_factors.json ``body`` (its verdict, tests and
    requests sent) and the ``command`` that ran it: a measurement, cached in ``state.json``."""
    return {
        "verdict": body["verdict"],
        "tests": body["tests"],
        "identity": body["identity"],
        "requests": {"sent": body["requests"]["sent"]},
        "command": command,
    }


def with_serving_factor(characterization: dict, factors: dict) -> dict:
    """``characterization`` with the verdict of ``factors`` (``measured_factor``'s value) merged
    in (module docstring); a new dict. A class ``none`` (the symptom, each case alone and cold, lost
    nothing) becomes ``state_dependent`` too when the experiment names a factor."""
    verdict, command = factors["verdict"], factors["command"]
    noted = {
        "named": verdict["named"],
        "kind": verdict["kind"],
        "arm": verdict["arm"],
        "sentence": verdict["sentence"],
        "min_loss": verdict["min_loss"],
        "min_power": verdict["min_power"],
        "requests": factors["requests"]["sent"],
        "command": command,
    }
    identity = factors.get("identity")  # absent in a measurement kept before output identity
    if identity is not None:
        noted["output"] = identity["verdict"]["sentence"]
    measured = {**characterization.get("measured", {}), "serving_factors": noted}
    if verdict["named"] is None:
        if identity is not None and identity["verdict"]["named"] is not None:
            return _output_departs(characterization, identity, factors, measured)
        return {**characterization, "measured": measured}
    test = next(t for t in factors["tests"] if t["arm"] == verdict["arm"])
    words = _words(verdict["named"])
    evidence = {
        "rule": f"the live endpoint loses recall in one serving state: {words} "
        f"({verdict['kind']}, arm {verdict['arm']}) against the same cases alone and cold",
        "effect": "recall lost",
        "factor": words,
        "factors": verdict["named"].split(" × "),
        "arm": verdict["arm"],
        "pairs": test["pairs"],
        "lost": test["lost"],
        "gained": test["gained"],
        "recall_baseline": test["recall_base"],
        "recall_in_state": test["recall_arm"],
        "p": test["p"],
        "p_holm": test["p_holm"],
        "requests": factors["requests"]["sent"],
        "null": "recall that no serving factor moves (exact McNemar, Holm across the arms)",
    }
    hint = "; ".join(_HINT.get(f, f) for f in evidence["factors"])
    clean = characterization["classes"][0] == "none"  # the symptom (alone, cold) lost nothing
    if clean:
        evidence["rule"] = (
            f"the symptom's cases, each alone and cold, lose nothing; in one serving state, {words} "
            f"({verdict['kind']}, arm {verdict['arm']}), the same cases lose recall"
        )
    text = (
        "the symptom's cases lose nothing alone and cold, but recall depends on the serving state, "
        if clean
        else "not among the suspects: the loss depends on the serving state, "
    ) + f"{words}: {verdict['sentence']}; {hint}"
    return _merged(characterization, evidence, command, text, measured)


def _merged(characterization: dict, evidence: dict, command: str, text: str, measured: dict) -> dict:
    """``characterization`` with ``state_dependent`` first and its ``evidence``, ``next`` and text."""
    others = [c for c in characterization["classes"] if c not in ("state_dependent", "undecided", "none")]
    return {
        **characterization,
        "classes": ["state_dependent", *others],
        "evidence": {
            "state_dependent": evidence,
            **{k: v for k, v in characterization["evidence"].items() if k not in ("state_dependent", "none")},
        },
        "undecided": [],
        "next": command,
        "text": text,
        "measured": measured,
    }


def _output_departs(characterization: dict, identity: dict, factors: dict, measured: dict) -> dict:
    """No serving state loses recall, but greedy output departs in one: ``state_dependent`` with
    the output evidence (a serving bug that a longer answer, or another model, pays for in recall)."""
    verdict = identity["verdict"]
    test = next(t for t in identity["tests"] if t["arm"] == verdict["arm"])
    words = _words(verdict["named"])
    evidence = {
        "rule": f"greedy output departs from the same cases' alone-and-cold output in one serving state: "
        f"{words} ({verdict['kind']}, arm {verdict['arm']}) more often than the same request sent again; "
        "recall holds there",
        "effect": "output departs",
        "factor": words,
        "factors": verdict["named"].split(" × "),
        "arm": verdict["arm"],
        "pairs": test["pairs"],
        "departs": test["departs"],
        "departs_repeat": test["departs_repeat"],
        "only_arm": test["only_arm"],
        "only_repeat": test["only_repeat"],
        "continuation": identity["continuation"],
        "p": test["p"],
        "p_holm": test["p_holm"],
        "requests": factors["requests"]["sent"],
        "null": "greedy output that departs from the baseline's no more often than the same request sent "
        "again (one-sided exact, Holm across the arms)",
    }
    hint = "; ".join(_HINT.get(f, f) for f in evidence["factors"])
    lead = (
        "the symptom's cases lose nothing alone and cold and no serving state loses recall, but greedy "
        "output depends on the serving state, "
        if characterization["classes"][0] == "none"
        else "not among the suspects: greedy output depends on the serving state (recall holds there), "
    )
    text = f"{lead}{words}: {verdict['sentence']}; {hint}"
    return _merged(characterization, evidence, factors["command"], text, measured)
