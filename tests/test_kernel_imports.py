"""The top-k kernels' floor plan (issue 36, the kernel cut): ``kernels/topk.py`` is the front and
holds the dispatcher only; each method module (bisection, radix select, filter) imports the shared
pieces of ``topk_parts`` and nothing from another method's module or from the front."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "src" / "needlescope" / "kernels"
METHODS = ("triton_bisect", "triton_radix", "triton_filter", "cuda_topk")


def _kernel_imports(name: str) -> set[str]:
    """The ``needlescope.kernels`` modules ``kernels/<name>.py`` imports, lazily or not."""
    tree = ast.parse((KERNELS / f"{name}.py").read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "needlescope.kernels":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("needlescope.kernels."):
            out.add(node.module.removeprefix("needlescope.kernels."))
        elif isinstance(node, ast.Import):
            out |= {a.name[20:] for a in node.names if a.name.startswith("needlescope.kernels.")}
    return out


def test_no_method_module_imports_another_or_the_front() -> None:
    for name in METHODS:
        bad = _kernel_imports(name) & ({*METHODS, "topk"} - {name})
        assert not bad, f"kernels/{name}.py imports {sorted(bad)}"
    assert not _kernel_imports("topk_parts") & {*METHODS, "topk"}


def test_the_front_holds_the_dispatcher_only() -> None:
    tree = ast.parse((KERNELS / "topk.py").read_text(encoding="utf-8"))
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert defs == ["topk_method", "topk"]
    assert _kernel_imports("topk") == set(METHODS), "the front imports exactly the four methods"
