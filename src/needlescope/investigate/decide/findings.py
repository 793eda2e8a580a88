"""``Findings``: what an investigation found, the value ``decide.decision.decide`` returns,
``run.run_investigation`` writes and ``report`` renders.

``investigation.json`` is ``Findings.to_json()`` (``schema.INVESTIGATION_SCHEMA``) and holds
``verdicts.json`` (``schema.VERDICTS_SCHEMA``) under ``verdicts``; both are checked when written
(``to_json``) and when read (``from_json``, ``read``). One suspect has one shape, ``Suspect``:
its identity, what was measured, the verdict, the reason and its ``role``, written into both
files' suspect lists (``investigation_json``, ``verdicts_json``) and joined back by ``from_json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from needlescope.investigate.decide.schema import INVESTIGATION_SCHEMA
from needlescope.investigate.decide.verdicts import validate_verdicts
from needlescope.schema import check_schema

__all__ = ["Findings", "Suspect", "validate_findings"]


def validate_findings(investigation: dict) -> None:
    """ValueError unless ``investigation`` follows ``INVESTIGATION_SCHEMA`` and its ``verdicts``
    follow ``VERDICTS_SCHEMA`` (``validate_verdicts``)."""
    check_schema(investigation, INVESTIGATION_SCHEMA, "investigation")
    validate_verdicts(investigation["verdicts"])


@dataclass(frozen=True)
class Suspect:
    """One suspect, decided. Identity (from the ledger): ``id``, ``tier``, ``hypothesis``,
    ``maps_to`` (the patch spec or "field=value ..."), ``changes_topk``, ``auto`` (an automatic
    suspect: a difference no ledger suspect names). Decision: ``verdict`` (``verdicts.VERDICTS``),
    ``reason`` (the measurement it rests on, in words), ``role`` (``verdicts.ROLES`` or None; a
    workaround's verdict stays what the rule says, its role says workaround). Measurements:
    ``present`` in the candidate (None: unknown), the paired ablation ``pair``, the final-logit
    ``divergence``, the ``sufficiency`` pair, the Holm-adjusted ``p_holm``, ``necessary`` /
    ``sufficient``, the ablation's ``power``, and on the live route ``live`` (the deciding
    path's comparison) and ``live_paths``; ``evidence``: every evidence record behind it."""

    id: str
    tier: int
    hypothesis: str
    maps_to: str
    changes_topk: bool
    auto: bool
    verdict: str
    reason: str
    evidence: tuple[dict, ...] = ()
    role: str | None = None
    present: bool | None = None
    pair: dict | None = None
    divergence: float | None = None
    sufficiency: dict | None = None
    necessary: bool | None = None
    sufficient: bool | None = None
    p_holm: float | None = None
    power: dict | None = None
    live: dict | None = None
    live_paths: dict | None = None

    _VERDICT_KEYS = ("auto", "role", "necessary", "sufficient", "p_holm", "power", "live_paths")
    _INVESTIGATION_KEYS = (
        "id", "tier", "hypothesis", "maps_to", "changes_topk", "auto", "verdict", "reason",
        "present", "pair", "divergence", "sufficiency",
    )  # fmt: skip

    @classmethod
    def of(cls, record: dict, evidence: list[dict]) -> Suspect:
        """From a decided record (a dict with at least the identity, ``verdict`` and ``reason``)."""
        names = {f.name for f in fields(cls)} - {"evidence"}
        return cls(**{k: v for k, v in record.items() if k in names}, evidence=tuple(evidence))

    def verdicts_json(self) -> dict:
        """This suspect in ``verdicts.json``."""
        head = {"id": self.id, "tier": self.tier, "verdict": self.verdict, "reason": self.reason}
        return {**head, "evidence": list(self.evidence), **{k: getattr(self, k) for k in self._VERDICT_KEYS}}

    def investigation_json(self) -> dict:
        """This suspect in ``investigation.json``'s ``suspects``."""
        out = {k: getattr(self, k) for k in self._INVESTIGATION_KEYS}
        return out if self.live is None else {**out, "live": self.live}


@dataclass(frozen=True)
class Findings:
    """One investigation's result (module docstring). ``route``: "in-process" | "live" | "dump";
    ``ledger``: the ledger's file name; ``target``: the model, device and endpoint or dump;
    ``symptom``: the ledger's symptom and the recall measured; ``configs``: every configuration
    measured; ``candidate_topk``; ``suspects`` (``Suspect``, tier order); ``fixes``: each replayed
    fix with its ``label_kind``; ``explained``: the failing case explained (in-process).
    ``verdicts.json``'s other keys: ``root_cause``, ``root_causes``, ``signature``,
    ``differences``, ``unaccounted_differences``, ``residual``, ``localization``, ``rank_paths``,
    ``nonfinite_scores``, ``multiplicity``, ``characterization``.

    Not serialized: ``out`` (the run directory: the report's images go there),
    ``candidate_records`` (the candidate's case records: the signature's plots) and
    ``ledger_sha256`` (the ledger the run measured)."""

    route: str
    ledger: str
    target: dict
    symptom: dict
    configs: dict
    candidate_topk: int | None
    suspects: tuple[Suspect, ...]
    fixes: tuple[dict, ...]
    explained: dict | None
    root_cause: str | None
    root_causes: tuple[str, ...]
    signature: dict
    differences: tuple[dict, ...]
    unaccounted_differences: tuple[dict, ...]
    multiplicity: dict
    residual: dict | None = None
    localization: dict | None = None
    rank_paths: dict | None = None
    nonfinite_scores: dict = field(default_factory=lambda: {"counts": {}, "findings": []})
    characterization: dict | None = None
    out: Path | None = None
    candidate_records: tuple[dict, ...] = ()
    ledger_sha256: str | None = None

    def suspect(self, sid: str) -> Suspect:
        """The suspect ``sid`` (KeyError when there is none)."""
        for s in self.suspects:
            if s.id == sid:
                return s
        raise KeyError(sid)

    @property
    def verdicts(self) -> dict:
        """``verdicts.json``'s content (schema ``VERDICTS_SCHEMA``)."""
        return {
            "symptom": self.symptom,
            "root_cause": self.root_cause,
            "root_causes": list(self.root_causes),
            "signature": self.signature,
            "suspects": [s.verdicts_json() for s in self.suspects],
            "differences": list(self.differences),
            "unaccounted_differences": list(self.unaccounted_differences),
            "residual": self.residual,
            "localization": self.localization,
            "rank_paths": self.rank_paths,
            "nonfinite_scores": self.nonfinite_scores,
            "multiplicity": self.multiplicity,
            "characterization": self.characterization,
        }

    def to_json(self) -> dict:
        """``investigation.json``'s content, checked against its schema (ValueError if not)."""
        obj = {
            "route": self.route,
            "ledger": self.ledger,
            "target": self.target,
            "symptom": self.symptom,
            "configs": self.configs,
            "candidate_topk": self.candidate_topk,
            "suspects": [s.investigation_json() for s in self.suspects],
            "fixes": list(self.fixes),
            "explained": self.explained,
            "verdicts": self.verdicts,
        }
        validate_findings(obj)
        return obj

    @classmethod
    def from_json(
        cls,
        obj: dict,
        *,
        out: str | Path | None = None,
        candidate_records: list[dict] = (),
        ledger_sha256: str | None = None,
    ) -> Findings:
        """The findings of ``investigation.json``'s content ``obj`` (checked against its schema
        first: ValueError naming the first key that does not fit)."""
        validate_findings(obj)
        v = obj["verdicts"]
        by_id = {s["id"]: s for s in obj["suspects"]}
        suspects = tuple(
            Suspect.of(
                {**by_id.get(s["id"], {}), **{k: x for k, x in s.items() if k != "evidence"}}, s["evidence"]
            )
            for s in v["suspects"]
        )
        rest = {
            k: v[k]
            for k in ("residual", "localization", "rank_paths", "nonfinite_scores", "characterization")
            if k in v
        }
        return cls(
            route=obj["route"],
            ledger=obj["ledger"],
            target=obj["target"],
            symptom=obj["symptom"],
            configs=obj["configs"],
            candidate_topk=obj["candidate_topk"],
            suspects=suspects,
            fixes=tuple(obj["fixes"]),
            explained=obj["explained"],
            root_cause=v["root_cause"],
            root_causes=tuple(v["root_causes"]),
            signature=v["signature"],
            differences=tuple(v["differences"]),
            unaccounted_differences=tuple(v["unaccounted_differences"]),
            multiplicity=v["multiplicity"],
            **rest,
            out=None if out is None else Path(out),
            candidate_records=tuple(candidate_records),
            ledger_sha256=ledger_sha256,
        )

    @classmethod
    def read(cls, out: str | Path) -> Findings:
        """The findings of a finished run directory (``investigation.json`` checked)."""
        out = Path(out)
        obj = json.loads((out / "investigation.json").read_text(encoding="utf-8"))
        cand, state = out / "measure" / "candidate.jsonl", out / "state.json"
        lines = cand.read_text(encoding="utf-8").splitlines() if cand.exists() else []
        # ``basis`` is the run's bookkeeping (``measure.basis``), not a finding
        records = [{k: v for k, v in json.loads(x).items() if k != "basis"} for x in lines if x.strip()]
        digest = (
            json.loads(state.read_text(encoding="utf-8")).get("ledger_sha256") if state.exists() else None
        )
        return cls.from_json(obj, out=out, candidate_records=records, ledger_sha256=digest)
