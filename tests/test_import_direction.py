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
    # 4: multi-step workflows: the investigation, and the others (demo, explain, rank dump, capture)
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


def test_the_checker_catches_an_upward_import(tmp_path):
    """The rule can fail: a lazy upward import and a torch import in a torch-free core are reported."""
    fake = tmp_path / "needlescope"
    (fake / "dsa").mkdir(parents=True)
    (fake / "dsa" / "bad.py").write_text("def f():\n    from needlescope.workflows import demo\n")
    (fake / "cases.py").write_text("import torch\n")
    found = _violations(fake)
    assert any("dsa (layer 2) imports workflows (layer 4)" in v for v in found), found
    assert any("cases is torch-free but imports torch" in v for v in found), found
