"""``decide(measured, ledger) -> Findings``: every decision of an investigation, once, from what
its route measured (pure, torch-free; the route protocol is ``decide.measured``).

Per route, the suspect rule that fits what was measured (``SUSPECT_RULES``): in-process, the
paired ablations (``causal.decide_suspects``: Holm, power, the roles and the root cause); live,
the emulations against the live capture (``live.decide_live``); dump, the cheap questions
(``dump.decide_dump``). Then, the same for every route: the evidence thresholds
(``thresholds``), the localization (``localization.decide_localization``: one departure rule),
the characterization (``characterize.characterize``, from the cached measurements: a run
resumed after a rule change decides anew) and ``verdicts.json``'s other keys.

The routes ask this module what to measure next (``localization_target``,
``characterization_needed``), so a rule is stated here once and measure/ only follows it.
"""

from __future__ import annotations

from dataclasses import replace

from needlescope.investigate.decide.blackbox import BlackboxContext, BlackboxEvidence, characterize_blackbox
from needlescope.investigate.decide.causal import decide_suspects, label_fixes, recall_by_length, symptom_loss
from needlescope.investigate.decide.characterize import Localized, characterize, nothing_to_explain
from needlescope.investigate.decide.dump import decide_dump
from needlescope.investigate.decide.findings import Findings, Suspect
from needlescope.investigate.decide.live import decide_live, live_root_cause
from needlescope.investigate.decide.localization import decide_localization, decide_rank_paths
from needlescope.investigate.decide.measured import CharacterizationInput, Measured
from needlescope.investigate.decide.serving_factor import with_serving_factor
from needlescope.investigate.decide.signature import NO_SIGNATURE, signature
from needlescope.investigate.decide.verdicts import (
    ALPHA,
    DIVERGE_REL,
    residual_verdict,
    restores,
    root_causes,
)
from needlescope.investigate.ledger.differences import AUTO_PREFIX
from needlescope.investigate.ledger.ledger import Ledger
from needlescope.investigate.ledger.plan import Config

__all__ = [
    "decide",
    "decide_inprocess_suspects",
    "localization_target",
    "characterization_needed",
    "decide_characterization",
    "thresholds",
    "SUSPECT_RULES",
]


def thresholds(evidence: list[dict]) -> list[dict]:
    """Evidence records with the threshold their rule compares them with: the exact McNemar p's
    ``ALPHA`` (ablation and sufficiency), the final-logit divergence's ``DIVERGE_REL`` (new dicts)."""

    def one(e: dict) -> dict:
        if e["check"] == "divergence":
            return {**e, "threshold": DIVERGE_REL}
        if e["check"] in ("ablation", "sufficiency") and e["metric"].endswith("exact McNemar p"):
            return {**e, "threshold": ALPHA}
        return e

    return [one(e) for e in evidence]


def decide_inprocess_suspects(m: list[dict], ref: list[dict], cand: list[dict], topk_runs: list[dict]):
    """(decided suspect records, {"root_cause", "multiplicity"}, signature) of an in-process run:
    what the in-process route asks before it measures the residual, and what ``decide`` decides."""
    sig = signature(cand, topk_runs) if cand else NO_SIGNATURE
    suspects, decided = decide_suspects(m, symptom_loss(ref, cand), sig["uninformative_ranking"])
    return suspects, decided, sig


def localization_target(residual_pair: dict, suspects: list[dict]) -> str | None:
    """What the in-process localizer runs on, or None: "residual" when the residual still loses,
    or loses cases too few for the exact test with no root cause (the localizer is then one of the
    characterization's experiments, its ``where`` family); "candidate" when a root cause is an
    automatic suspect (nobody named it: show where in the model it acts)."""
    if restores(residual_pair):
        return "residual"
    roots = root_causes(suspects)
    if any(r.startswith(AUTO_PREFIX) for r in roots):
        return "candidate"
    if residual_pair["b"] > residual_pair["c"] and not roots:
        return "residual"
    return None


def _named_root(suspects: list[dict]) -> bool:
    """A suspect the ledger names is a root cause: it explains the loss."""
    return any(
        s["verdict"] == "implicated" and s["present"] and not s["id"].startswith(AUTO_PREFIX)
        and s.get("role") == "root cause"
        for s in suspects
    )  # fmt: skip


def characterization_needed(
    route: str, ref: list[dict], cand: list[dict], suspects: list[dict], root
) -> bool:
    """Whether the route measures a characterization: recall is lost and no suspect the ledger
    names explains it (in-process: no named root cause; live: no root cause at all)."""
    scored = [r for r in cand if not r.get("error")]
    if not scored or nothing_to_explain(ref, scored) is not None:
        return False
    return not _named_root(suspects) if route == "in-process" else root is None


def decide_characterization(m: Measured, suspects: list[dict], root) -> dict | None:
    """``verdicts.json`` ``characterization``: None when nothing ran or a named suspect explains
    the loss; "none" when no recall is lost; else the classes from the measured evidence."""
    if m.route == "blackbox":
        if m.blackbox is None:
            return None
        ev = BlackboxEvidence.from_json(m.blackbox["evidence"])
        return {
            **characterize_blackbox(ev, BlackboxContext.from_json(m.blackbox["context"])),
            "measured": m.blackbox,
        }
    scored = [r for r in m.candidate_records if not r.get("error")]
    if (
        m.route == "dump"
        or not scored
        or (m.route == "live" and (root is not None or m.candidate_topk is None))
    ):
        return None
    none = nothing_to_explain(m.reference_records, scored)
    if none is not None:
        return _with_factor(none, m)
    if m.route == "in-process" and _named_root(suspects):
        return None
    ci: CharacterizationInput | None = m.characterization
    if ci is None:
        return None
    ev = ci.evidence
    if m.route == "in-process":
        ev = replace(ev, localized=_localized(decide_localization(m.localization)))
    return _with_factor({**characterize(ev, ci.context), "measured": _measured(ev, ci.baseline)}, m)


def _with_factor(characterization: dict, m: Measured) -> dict:
    """``characterization`` with the serving-factor experiment's verdict, when one ran (live,
    ``--serving-factors``): a named factor makes it ``state_dependent`` even where the symptom
    (each case alone and cold) lost nothing."""
    return (
        characterization
        if m.serving_factor is None
        else with_serving_factor(characterization, m.serving_factor)
    )


def _localized(localization: dict | None) -> tuple[Localized, ...]:
    if not localization:
        return ()
    return tuple(
        Localized(
            p["path"], p.get("first_divergent_module"), p.get("module_type"), p.get("layer"), p.get("finding")
        )
        for p in localization.get("paths", [])
    )


def _measured(ev, baseline: str) -> dict:
    """The numbers the rules read, for the report: cells and per-layer selection comparisons."""
    keys = ("layer", "path", "rows", "overlap", "chance", "needle_reference", "needle_candidate")
    return {
        "baseline": baseline,
        "not_reproduced": ev.not_reproduced,
        "rerun": ev.rerun,
        "cells": [c.__dict__ for c in ev.cells],
        "layers": [
            {k: getattr(s, k) for k in keys} | {"shift_overlap": s.shift_overlap, "tail_share": s.tail_share}
            for s in ev.layers
        ],
    }


def _inprocess(m: Measured, ledger: Ledger):
    suspects, decided, sig = decide_inprocess_suspects(
        m.suspects, m.reference_records, m.candidate_records, m.topk_runs
    )
    root = decided["root_cause"]
    residual = None
    if m.residual is not None:
        residual = {
            **residual_verdict(m.residual["pair"], m.residual["removed"]),
            "config": m.residual["config"],
        }
    extra = {
        "multiplicity": decided["multiplicity"],
        "residual": residual,
        "localization": decide_localization(m.localization),
        "fixes": label_fixes(m.fixes, suspects, root),
    }
    return suspects, root, sig, extra


def _live(m: Measured, ledger: Ledger):
    suspects = [decide_live(s) for s in m.suspects]
    root = live_root_cause(suspects)
    return (
        suspects,
        root,
        NO_SIGNATURE,
        {"localization": decide_localization(m.localization) if root is None else None},
    )


def _dump(m: Measured, ledger: Ledger):
    return (
        [decide_dump(s) for s in m.suspects],
        None,
        NO_SIGNATURE,
        {"localization": decide_localization(m.localization)},
    )


def _blackbox(m: Measured, ledger: Ledger):
    """No suspect is tested from outside (nothing can be emulated against answers alone): the
    characterization is the finding."""
    return [], None, NO_SIGNATURE, {"localization": None}


SUSPECT_RULES = {"in-process": _inprocess, "live": _live, "dump": _dump, "blackbox": _blackbox}
"""route -> its decision: (decided suspect records, root cause, signature, route-specific keys).
A new route adds its function here (and ``Measured.route`` names it)."""


def decide(measured: Measured, ledger: Ledger) -> Findings:
    """Every verdict of one investigation, decided once from ``measured`` (module docstring)."""
    m = measured
    suspects, root, sig, extra = SUSPECT_RULES[m.route](m, ledger)
    symptom = {
        **ledger.symptom.to_json(),
        "reference": Config(ledger.target.reference).label(),
        "candidate": m.candidate_label,
        "recall_reference": recall_by_length(m.reference_records),
        "recall_candidate": recall_by_length(m.candidate_records),
        "cases": len(m.candidate_records),
        **m.symptom_extra,
    }
    typed = tuple(
        Suspect.of(s, thresholds(m.evidence.get(s["id"], [])) + s.get("decision_evidence", []))
        for s in suspects
    )
    verdict_of = {s.id: s.verdict for s in typed}
    rows = [d.to_json(verdict_of.get(d.suspect)) for d in m.differences]
    roots = root_causes(suspects)
    return Findings(
        route=m.route,
        ledger=ledger.path.name,
        target=m.target,
        symptom=symptom,
        configs=m.configs,
        candidate_topk=m.candidate_topk,
        suspects=typed,
        fixes=tuple(extra.get("fixes", ())),
        explained=m.explained,
        root_cause=root,
        root_causes=tuple(roots if root is None or root in roots else [root, *roots]),
        signature=sig,
        differences=tuple(rows),
        unaccounted_differences=tuple(d for d in rows if not d["covered_by"] and d["suspect"] in verdict_of),
        multiplicity=extra.get(
            "multiplicity",
            {"method": "holm", "tests": sum(s.get("pair") is not None for s in suspects), "alpha": ALPHA},
        ),
        residual=extra.get("residual"),
        localization=extra.get("localization"),
        rank_paths=decide_rank_paths(m.rank_paths),
        nonfinite_scores=m.nonfinite_scores,
        characterization=decide_characterization(m, suspects, root),
    )
