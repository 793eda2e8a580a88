"""docs/architecture.md names real code: every dotted name in its capability and package tables
that starts at a top-level package of needlescope resolves to a module or an attribute of one
(``a.{b,c}`` names both; a ``*`` glob is skipped)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TOPS = {p.name.removesuffix(".py") for p in (ROOT / "src" / "needlescope").iterdir()} - {
    "__pycache__",
    "py.typed",
}
_TICKED = re.compile(r"`([^`]+)`")
_DOTTED = re.compile(r"^(?:needlescope\.)?[a-z_][a-z0-9_]*(?:\.(?:[A-Za-z_][A-Za-z0-9_]*|\{[a-z0-9_,]+\}))*$")


def _table_rows() -> list[str]:
    rows, in_tables = [], False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## Where each capability lives"):
            in_tables = True
        elif line.startswith("## ") and in_tables:
            break
        if in_tables and line.startswith("|") and not line.startswith("|---"):
            rows.append(line)
    return rows


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for part in m.group(1).split(",") for x in _expand(name[: m.start()] + part + name[m.end() :])]


def dotted_names() -> list[str]:
    names = set()
    for row in _table_rows():
        for ticked in _TICKED.findall(row):
            if (
                "*" in ticked
                or ticked.endswith(".py")
                or not _DOTTED.match(ticked)
                or ticked.removeprefix("needlescope.").split(".")[0] not in TOPS
            ):
                continue  # a glob, a file or command name, or a name relative to the row's package
            names.update(_expand(ticked.removeprefix("needlescope.")))
    return sorted(names)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("needlescope." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_tables_name_code():
    names = dotted_names()
    assert len(names) > 80, names  # the tables were read
    assert [n for n in names if not _resolves(n)] == []


@pytest.mark.parametrize("name", ["investigate.runner.run_investigation", "investigate.{diagnosis,ledger}"])
def test_a_stale_name_is_caught(name):
    assert not all(_resolves(n) for n in _expand(name))
