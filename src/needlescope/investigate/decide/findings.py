"""``Findings``: what an investigation found, the value ``run_investigation`` returns and
``report`` renders; and the assembly and checks of its two artifacts.

``verdicts.json`` (``schema.VERDICTS_SCHEMA``) is built by ``build_verdicts`` from the decided
suspects, the evidence and the differences; ``investigation.json``
(``schema.INVESTIGATION_SCHEMA``) holds it under ``verdicts`` beside everything else the report
shows. Both are checked (``validate_findings``) before ``run.run_investigation`` writes them,
each once; ``Findings.read`` loads a finished run directory back (checked the same way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from needlescope.investigate.decide.schema import INVESTIGATION_SCHEMA
from needlescope.investigate.decide.verdicts import ALPHA, root_causes, validate_verdicts
from needlescope.schema import check_schema

__all__ = ["Findings", "build_verdicts", "validate_findings"]

_SUSPECT_KEYS = ("auto", "role", "necessary", "sufficient", "p_holm", "power", "live_paths")


def build_verdicts(
    *, symptom: dict, root: str | None, sig: dict, suspects: list[dict], diffs: list, evidence: dict, **extra
) -> dict:
    """``verdicts.json`` from the decided ``suspects``: ``evidence`` maps a suspect id to its
    evidence records (a decided record's ``decision_evidence`` follows them); ``diffs`` are
    ``differences.Difference`` values; ``extra``: the keys beyond the suspects (``residual``,
    ``localization``, ...; defaults when not given)."""
    ids = {s["id"] for s in suspects}
    rows = [d.to_json(next((s["verdict"] for s in suspects if s["id"] == d.suspect), None)) for d in diffs]
    roots = root_causes(suspects)
    return {
        "symptom": symptom,
        "root_cause": root,
        "root_causes": roots if root is None or root in roots else [root, *roots],
        "signature": sig,
        "suspects": [
            {
                "id": s["id"],
                "tier": s["tier"],
                "verdict": s["verdict"],
                "reason": s["reason"],
                "evidence": evidence[s["id"]] + s.get("decision_evidence", []),
                **{k: s.get(k) for k in _SUSPECT_KEYS},
            }
            for s in suspects
        ],
        "differences": rows,
        "unaccounted_differences": [d for d in rows if not d["covered_by"] and (d["suspect"] in ids)],
        "residual": None,
        "localization": None,
        "rank_paths": None,
        "nonfinite_scores": {"counts": {}, "findings": []},
        "multiplicity": {
            "method": "holm",
            "tests": sum(s.get("pair") is not None for s in suspects),
            "alpha": ALPHA,
        },
        **extra,
    }


def validate_findings(investigation: dict) -> None:
    """ValueError unless ``investigation`` follows ``INVESTIGATION_SCHEMA`` and its ``verdicts``
    follow ``VERDICTS_SCHEMA`` (``validate_verdicts``)."""
    check_schema(investigation, INVESTIGATION_SCHEMA, "investigation")
    validate_verdicts(investigation["verdicts"])


@dataclass(frozen=True)
class Findings:
    """One investigation's result. ``investigation``: the content of ``investigation.json``
    (``verdicts`` inside it is ``verdicts.json``); ``candidate_records``: the candidate's case
    records (the signature's plots); ``ledger_sha256``: the ledger the run measured; ``out``:
    the run directory (the report's images go there)."""

    out: Path
    investigation: dict
    candidate_records: list[dict]
    ledger_sha256: str | None

    @property
    def verdicts(self) -> dict:
        return self.investigation["verdicts"]

    @property
    def root_cause(self) -> str | None:
        return self.verdicts["root_cause"]

    @classmethod
    def read(cls, out: str | Path) -> Findings:
        """The findings of a finished run directory (``investigation.json`` checked)."""
        out = Path(out)
        inv = json.loads((out / "investigation.json").read_text(encoding="utf-8"))
        validate_findings(inv)
        cand, state = out / "measure" / "candidate.jsonl", out / "state.json"
        lines = cand.read_text(encoding="utf-8").splitlines() if cand.exists() else []
        # ``basis`` is the run's bookkeeping (``measure.basis``), not a finding
        records = [{k: v for k, v in json.loads(x).items() if k != "basis"} for x in lines if x.strip()]
        digest = (
            json.loads(state.read_text(encoding="utf-8")).get("ledger_sha256") if state.exists() else None
        )
        return cls(out, inv, records, digest)
