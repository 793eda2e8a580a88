"""docs/architecture.md names real code, and its relations are true:

- every dotted name in its capability and package tables that starts at a top-level package of
  needlescope resolves to a module or an attribute of one (``a.{b,c}`` names both; a ``*`` glob
  is skipped);
- every "`A` (from `B`, `C`)" of the tables is a relation the source shows: A's name appears in
  the module that defines B or C (B calls, imports or registers A)."""

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


_FROM = re.compile(r"`([^`]+)` \(from ((?:`[^`]+`(?:, )?)+)")
SRC = ROOT / "src" / "needlescope"


def relations() -> list[tuple[str, list[str]]]:
    """(A, [B, ...]) of every "`A` (from `B`, ...)" in the tables."""
    return [(m.group(1), _TICKED.findall(m.group(2))) for row in _table_rows() for m in _FROM.finditer(row)]


def _module_source(name: str) -> str:
    """The source of the module that defines ``name``: a dotted name resolved as above, or a bare
    function or class name found by its ``def``/``class`` line."""
    if "." in name:
        parts = name.removeprefix("needlescope.").split(".")
        for cut in range(len(parts), 0, -1):
            path = SRC.joinpath(*parts[:cut])
            for f in (path.with_suffix(".py"), path / "__init__.py"):
                if f.is_file():
                    return f.read_text(encoding="utf-8")
        return ""
    found = [
        f.read_text(encoding="utf-8")
        for f in SRC.rglob("*.py")
        if re.search(rf"^(?:def|class) {re.escape(name)}\b", f.read_text(encoding="utf-8"), re.M)
    ]
    return "\n".join(found)


def _holds(callee: str, callers: list[str]) -> bool:
    leaves = [n.split(".")[-1] for n in _expand(callee)]
    return all(
        any(re.search(rf"\b{re.escape(leaf)}\b", _module_source(c)) for c in callers) for leaf in leaves
    )


def test_every_from_relation_holds():
    rels = relations()
    assert len(rels) >= 4, rels  # the tables were read
    assert [r for r in rels if not _holds(*r)] == []


def test_a_false_relation_is_caught():
    assert not _holds("dsa.loading.load_placed", ["cases.assemble"])
    assert not _holds("investigate.measure.live.LiveRoute", ["investigate.run.run_investigation"])
