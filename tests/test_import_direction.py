"""The layer rule of docs/architecture.md, checked on the source: a lower layer never imports a higher one.

Every ``import`` and ``from ... import`` of a ``needlescope`` module anywhere in a file counts,
including the lazy ones inside functions: a lazy import still makes the lower layer depend on
the higher one. A new top-level module or package must be given a layer here (and in the doc).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "needlescope"

LAYERS: dict[str, int] = {
    # 0: values every layer may use
    "__init__": 0,
    "errors": 0,
    "schema": 0,
    "setting": 0,
    "paths": 0,
    "progress": 0,
    "outdir": 0,
    "devices": 0,
    # 1: torch-free cores
    "cases": 1,
    "analysis": 1,
    "targets": 1,
    "report": 1,
    # 2: running probes, the indexer math and checkpoints, the model organism's assets
    "run": 2,
    "dsa": 2,
    "organism": 2,
    # 3: things that run a model or a server
    "serve": 3,
    "kernels": 3,
    "audit": 3,
    # 4: multi-step workflows: the investigation, and the others (serve-probe-explain, explain, rank dump, capture)
    "investigate": 4,
    "workflows": 4,
    # 5: long-running watchers built on workflows
    "watch": 5,
    # 6: the command line
    "cli": 6,
    # test support may use anything below the CLI; nothing in the library imports it
    "testing": 5,
}

# Same-layer edges that would make a cycle: dsa loads checkpoints and must not need the organism
# package (which imports dsa); the torch-free cores of layer 1 and run never need dsa.
FORBIDDEN = {("dsa", "organism"), ("dsa", "run"), ("run", "dsa"), ("run", "organism")}
TORCH_FREE = (
    "setting",
    "schema",
    "errors",
    "paths",
    "progress",
    "outdir",
    "cases",
    "analysis",
    "targets",
    "report",
    "run",
)


def _top(path: Path, root: Path = SRC) -> str:
    return path.relative_to(root).parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
            if node.module == "needlescope":
                out += [(f"needlescope.{alias.name}", node.lineno) for alias in node.names]
    return out


def _violations(root: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = _top(path, root)
        for module, line in _imports(path):
            where = f"{path.relative_to(root.parent)}:{line}"
            if module.split(".")[0] == "torch" and src in TORCH_FREE:
                bad.append(f"{where}: {src} is torch-free but imports {module}")
            if not module.startswith("needlescope."):
                continue
            dst = module.split(".")[1]
            dst = "__init__" if dst.startswith("__") else dst  # from needlescope import __version__
            if dst not in LAYERS:
                bad.append(f"{where}: imports needlescope.{dst}, which has no layer in this test")
            elif LAYERS[dst] > LAYERS[src] or (src, dst) in FORBIDDEN:
                bad.append(f"{where}: {src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})")
            elif dst == "testing" and src != "testing":
                bad.append(f"{where}: the library imports test support (needlescope.testing)")
    return bad


def test_every_module_has_a_layer():
    tops = {_top(p) for p in SRC.rglob("*.py")}
    assert tops <= set(LAYERS), f"give these a layer: {sorted(tops - set(LAYERS))}"


def test_no_lower_layer_imports_a_higher_one():
    assert _violations() == []


# The investigation's rooms (docs/architecture.md): run.py -> measure/, report/ -> decide/ -> ledger/.
# A room imports only rooms of a lower rank; measure/ and report/ share a rank and never import
# each other (the report renders from Findings, never from a measurement).
ROOMS: dict[str, int] = {"ledger": 0, "decide": 1, "measure": 2, "report": 2, "run": 3}
TORCH_FREE_ROOMS = ("ledger", "decide", "report")
NEEDS_TORCH = ("torch", "needlescope.dsa", "needlescope.kernels", "needlescope.serve", "needlescope.audit")


def _room(path: Path, root: Path) -> str | None:
    parts = path.relative_to(root).parts
    return parts[1].removesuffix(".py") if len(parts) > 1 and parts[0] == "investigate" else None


def _room_violations(root: Path = SRC) -> list[str]:
    bad = []
    for path in sorted((root / "investigate").rglob("*.py")):
        src = _room(path, root)
        if src not in ROOMS:
            continue
        for module, line in _imports(path):
            where = f"{path.relative_to(root.parent)}:{line}"
            if src in TORCH_FREE_ROOMS and any(
                module == t or module.startswith(t + ".") for t in NEEDS_TORCH
            ):
                bad.append(f"{where}: investigate.{src} is torch-free but imports {module}")
            parts = module.split(".")
            if parts[:2] != ["needlescope", "investigate"] or len(parts) < 3:
                continue
            dst = parts[2]
            if dst not in ROOMS:
                bad.append(f"{where}: imports investigate.{dst}, which has no room in this test")
            elif dst != src and ROOMS[dst] >= ROOMS[src]:
                bad.append(f"{where}: investigate.{src} imports investigate.{dst}")
    return bad


def test_every_investigate_module_has_a_room():
    rooms = {_room(p, SRC) for p in (SRC / "investigate").rglob("*.py")} - {"__init__"}
    assert rooms <= set(ROOMS), f"give these a room: {sorted(rooms - set(ROOMS))}"


def test_the_investigation_imports_down_its_rooms():
    assert _room_violations() == []


def test_the_room_checker_catches_a_report_reading_a_measurement(tmp_path):
    fake = tmp_path / "needlescope" / "investigate"
    for room in ("report", "decide"):
        (fake / room).mkdir(parents=True)
    (fake / "report" / "bad.py").write_text("from needlescope.investigate.measure.session import Session\n")
    (fake / "decide" / "bad.py").write_text("def f():\n    import torch\n")
    found = _room_violations(tmp_path / "needlescope")
    assert any("investigate.report imports investigate.measure" in v for v in found), found
    assert any("investigate.decide is torch-free but imports torch" in v for v in found), found


def test_the_checker_catches_an_upward_import(tmp_path):
    """The rule can fail: a lazy upward import and a torch import in a torch-free core are reported."""
    fake = tmp_path / "needlescope"
    (fake / "dsa").mkdir(parents=True)
    (fake / "dsa" / "bad.py").write_text(
        "def f():\n    from needlescope.workflows import serve_probe_explain\n"
    )
    (fake / "cases.py").write_text("import torch\n")
    found = _violations(fake)
    assert any("dsa (layer 2) imports workflows (layer 4)" in v for v in found), found
    assert any("cases is torch-free but imports torch" in v for v in found), found


def test_watch_uses_only_the_torch_free_cores():
    """docs/architecture.md: the watchers import nothing above layer 1 but themselves."""
    bad = [
        f"{path.relative_to(SRC.parent)}:{line}: {module}"
        for path in sorted((SRC / "watch").rglob("*.py"))
        for module, line in _imports(path)
        if module.startswith("needlescope.")
        and module.split(".")[1] != "watch"
        and LAYERS[module.split(".")[1]] > 1
    ]
    assert bad == []


def _module_graph(root: Path = SRC) -> dict[str, set[str]]:
    """needlescope module -> the needlescope modules it imports (lazy imports included)."""
    names = {
        ".".join(("needlescope", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for p in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        name = ".".join(("needlescope", *path.relative_to(root).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        graph[name] = {m for m, _ in _imports(path) if m in names and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_house_has_no_import_circle():
    """No module imports one that imports it back, directly or around a loop, lazy imports
    included (the old investigate.live <-> runner and kernels.triton_topk <-> radix / filter)."""
    assert _cycles(_module_graph()) == []


def test_the_circle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
