"""Golden ``Findings`` (tests/golden/findings/*.json): real runs' ``investigation.json``, one per
route and per kind of result, so that the report and the decisions over them are tested in
milliseconds without a model (tests/golden/findings/README.md says where each one came from)."""

from __future__ import annotations

import json
from pathlib import Path

from needlescope.investigate.decide.findings import Findings

GOLDEN = Path(__file__).parent / "golden" / "findings"


def names() -> list[str]:
    """Every golden file's name (without ``.json``)."""
    return sorted(p.stem for p in GOLDEN.glob("*.json"))


def raw(name: str) -> dict:
    """The golden ``investigation.json`` content ``name``."""
    return json.loads((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))


def golden(name: str, out: Path | None = None) -> Findings:
    """The golden findings ``name`` (schema-checked on reading), rendering into ``out``."""
    return Findings.from_json(raw(name), out=out, ledger_sha256="0" * 64)
