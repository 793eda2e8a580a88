"""``Measured``: what a route hands ``decide`` (typed, torch-free; no verdict, no threshold).

The route protocol: a route is a module of ``investigate/measure/`` with one entry point,
``measure(session) -> Measured``, that runs whatever its candidate allows (a model in this
process, a live endpoint, an engine's tensor dump, ...) and returns its measurements. It may
ask ``decide`` what to measure next (the residual of the implicated suspects, whether a
characterization is needed) but keeps no decision: ``decide.decision.decide(measured, ledger)``
makes every one, once, from this value. A new route fills the fields it can and leaves the
others at their defaults; ``decide`` dispatches on ``route`` to the suspect rule that fits what
was measured (``SUSPECT_RULES`` there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from needlescope.investigate.decide.characterize import Context, Evidence
from needlescope.investigate.ledger.differences import Difference

__all__ = ["Measured", "CharacterizationInput"]


@dataclass(frozen=True)
class CharacterizationInput:
    """The measurements ``decide.characterize.characterize`` reads: ``evidence`` (without the
    localizer's result: ``decide`` adds it from ``Measured.localization``), ``context`` (how the
    user reaches the candidate, for the ``next`` command) and the ``baseline`` the target was
    compared with (its label)."""

    evidence: Evidence
    context: Context
    baseline: str

    def to_json(self) -> dict:
        """This input as JSON (``state.json`` caches it; ``from_json`` reads it back)."""
        return {
            "evidence": self.evidence.to_json(),
            "context": self.context.to_json(),
            "baseline": self.baseline,
        }

    @classmethod
    def from_json(cls, obj: dict) -> CharacterizationInput:
        return cls(
            Evidence.from_json(obj["evidence"]),
            Context.from_json(obj["context"]),
            obj["baseline"],
        )


@dataclass(frozen=True)
class Measured:
    """One route's measurements (module docstring).

    ``route``: "in-process" | "live" | "dump" (what ``investigation.json`` says);
    ``target``: the target's description (model, device, and the endpoint or the dump);
    ``candidate_label``: what the candidate is, in words or as its configuration label;
    ``reference_records`` / ``candidate_records``: the symptom's case records
    (``measure.records``; the live route's are the endpoint's, errors included);
    ``symptom_extra``: the route's own symptom numbers (the live route: failing cases, its
    ``index_topk``); ``configs``: name -> ``Config.to_json()`` of every configuration measured;
    ``suspects``: one measured record per suspect, tier order (``measure.session.
    suspect_identity`` plus the route's measurements); ``evidence``: suspect id -> its evidence
    records (questions, presence, audits, ablation, sufficiency; ``decide`` adds the thresholds);
    ``differences``: ``ledger.differences.Difference`` values (the live server's included);
    ``candidate_topk``: the candidate's ``index_topk`` as measured.

    In-process only (defaults elsewhere): ``fixes`` (each replayed fix paired with the candidate,
    unlabelled), ``topk_runs`` (the runs that differ only in ``index_topk``: the signature's
    input), ``explained`` (the explained case and both records), ``residual`` ({"removed",
    "config", "pair"}), ``rank_paths``, ``nonfinite_scores``. Every route: ``localization`` (the
    measured localization, ``decide.localization``'s input), ``characterization``
    (``CharacterizationInput``; None when none was measured). Live with ``--serving-factors``:
    ``serving_factor`` (``decide.serving_factor.measured_factor``'s value; None when not run)."""

    route: str
    target: dict
    candidate_label: str
    reference_records: list[dict]
    candidate_records: list[dict]
    configs: dict[str, dict]
    suspects: list[dict]
    evidence: dict[str, list[dict]]
    differences: list
    candidate_topk: int | None = None
    symptom_extra: dict = field(default_factory=dict)
    fixes: list[dict] = field(default_factory=list)
    topk_runs: list[dict] = field(default_factory=list)
    explained: dict | None = None
    residual: dict | None = None
    localization: dict | None = None
    characterization: CharacterizationInput | None = None
    rank_paths: dict | None = None
    nonfinite_scores: dict = field(default_factory=lambda: {"counts": {}, "findings": []})
    blackbox: dict | None = None
    serving_factor: dict | None = None

    def to_json(self) -> dict:
        """Every field as JSON, in field order (``from_json`` reads it back): what a golden
        ``Measured`` file holds (tests/golden/measured), so ``decide`` is tested without a model."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["differences"] = [d.to_record() for d in self.differences]
        out["characterization"] = None if self.characterization is None else self.characterization.to_json()
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Measured:
        char = obj["characterization"]
        return cls(
            **{
                **obj,
                "differences": [Difference.from_record(d) for d in obj["differences"]],
                "characterization": None if char is None else CharacterizationInput.from_json(char),
            }
        )
