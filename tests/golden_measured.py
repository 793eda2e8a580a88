"""Golden ``Measured`` (tests/golden/measured/NAME/measured.json, beside the ledger it was measured
under): a real run's measurements on their way into ``decide``, so that the decisions are tested
in milliseconds without a model (tests/golden/measured/README.md says where each one came from)."""

from __future__ import annotations

import json
from pathlib import Path

from needlescope.investigate.decide.decision import decide
from needlescope.investigate.decide.measured import Measured
from needlescope.investigate.ledger.ledger import Ledger, load_ledger
from needlescope.paths import relativize

MEASURED = Path(__file__).parent / "golden" / "measured"


def names() -> list[str]:
    """Every golden Measured's name (its folder)."""
    return sorted(p.parent.name for p in MEASURED.glob("*/measured.json"))


def measured(name: str) -> Measured:
    """The golden Measured ``name``."""
    return Measured.from_json(json.loads((MEASURED / name / "measured.json").read_text(encoding="utf-8")))


def ledger(name: str) -> Ledger:
    """The ledger the golden Measured ``name`` was measured under."""
    return load_ledger(MEASURED / name / "investigation.toml")


def decided(m: Measured, ledger_name: str) -> dict:
    """``decide(m, ledger)`` as ``investigation.json`` holds it (no absolute path: ``relativize``
    as a run does, the ledger's folder mapped to nothing)."""
    obj = json.loads(json.dumps(decide(m, ledger(ledger_name)).to_json()))  # tuples as the file has them
    return relativize(obj, {str(MEASURED / ledger_name) + "/": ""})
