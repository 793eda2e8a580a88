"""Run the conformance suite (``kernels.conformance``) over implementations named ``MODULE:FUNCTION``.

``load_impl`` resolves a name: ``ours`` (every entry of ``topk_impls.OURS`` that runs on the
rows' device: the ``GPU_ONLY`` ones need CUDA rows), ``ours:NAME`` (one of them), ``torch`` (``topk_impls.torch_topk``), ``MODULE:FUNCTION`` (an importable module, the
working directory on the path as with ``python -m``) or ``PATH.py:FUNCTION`` (a file). Every
bad name is one ``BadInput``. ``conform`` runs them and returns the report ``REPORT_SCHEMA``
describes (docs/conformance.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from needlescope.errors import BadInput
from needlescope.kernels.conformance import TopK, cases, expected, run_case

__all__ = ["REPORT_SCHEMA", "load_impl", "conform"]

_CASE = {
    "type": "object",
    "required": ["name", "rows", "width", "k", "exact", "rows_inexact", "recall_mean", "recall_min"]
    + ["worst_row", "worst_missed", "worst_wrong", "missed", "wrong", "lower_index_ties", "error"]
    + ["inputs_written"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "rows": {"type": "integer"},
        "width": {"type": "integer"},
        "k": {"type": "integer"},
        "exact": {"type": "boolean"},
        "rows_inexact": {"type": ["integer", "null"]},
        "recall_mean": {"type": ["number", "null"]},
        "recall_min": {"type": ["number", "null"]},
        "worst_row": {"type": ["integer", "null"]},
        "worst_missed": {"type": ["integer", "null"]},
        "worst_wrong": {"type": ["integer", "null"]},
        "missed": {"type": ["integer", "null"]},
        "wrong": {"type": ["integer", "null"]},
        "lower_index_ties": {"type": ["boolean", "null"]},
        "error": {"type": ["string", "null"]},
        "inputs_written": {"type": "array", "items": {"type": "string", "enum": ["scores", "lengths"]}},
    },
}

REPORT_SCHEMA = {
    "type": "object",
    "required": ["shapes", "device", "seed", "torch", "triton", "impls"],
    "properties": {
        "shapes": {"type": "string"},
        "device": {"type": "string"},
        "seed": {"type": "integer"},
        "torch": {"type": "string"},
        "triton": {"type": ["string", "null"]},
        "impls": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["impl", "exact", "wrote_inputs", "cases"],
                "properties": {
                    "impl": {"type": "string"},
                    "exact": {"type": "boolean"},
                    "wrote_inputs": {"type": "array", "items": {"type": "string"}},
                    "cases": {"type": "array", "items": _CASE},
                },
            },
        },
    },
}
"""The report ``conform`` returns (and the CLI writes as JSON): per implementation, whether every
case was exact, the cases in which it wrote into its inputs (``wrote_inputs``, a finding of its
own) and each case's ``CaseResult`` (``kernels.conformance``)."""


def _import_function(spec: str) -> TopK:
    module_name, sep, func = spec.rpartition(":")
    if not sep or not module_name or not func:
        raise BadInput(f"--impl takes MODULE:FUNCTION (or PATH.py:FUNCTION, ours, torch); got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise BadInput(f"--impl {spec}: no file {module_name}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except BadInput:
        raise
    except Exception as e:  # any import failure of user code is the user's input to fix
        raise BadInput(f"--impl {spec}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise BadInput(f"--impl {spec}: {module_name} has no callable {func!r}")
    return fn


def _need_triton(spec: str, ours: dict, gpu_only: tuple[str, ...]) -> None:
    """BadInput, once, when ``spec`` names a Triton path of ours and Triton is not installed: the
    GPU extra is missing (an install to make, not a kernel that is wrong)."""
    if spec != "ours" and not spec.startswith("ours:"):
        return
    name = spec.removeprefix("ours").removeprefix(":")
    if name in ("reference", *gpu_only) or (name and name not in ours):
        return  # Triton-free, or an unknown name load_impl refuses itself
    try:
        import triton  # noqa: F401  (TRITON_INTERPRET is set before this, as the kernels need)
    except ImportError:
        raise BadInput(
            f"--impl {spec} runs needlescope's Triton kernels, and Triton is not installed: the GPU extra "
            "is missing; install it with pip install 'needlescope[gpu]' (--impl ours:reference and "
            "--impl torch run without it)"
        ) from None


def load_impl(spec: str, device: str = "cpu") -> list[tuple[str, TopK]]:
    """(name, callable) pairs for one ``--impl`` value (module docstring), for rows on ``device``."""
    from needlescope.kernels.topk_impls import GPU_ONLY, OURS, torch_topk

    gpu = torch.device(device).type == "cuda"
    _need_triton(spec, OURS, GPU_ONLY)
    if spec == "ours":
        return [(f"ours:{name}", fn) for name, fn in OURS.items() if gpu or name not in GPU_ONLY]
    if spec.startswith("ours:"):
        name = spec.removeprefix("ours:")
        if name not in OURS:
            raise BadInput(f"--impl {spec}: ours has {', '.join(OURS)}")
        if name in GPU_ONLY and not gpu:
            raise BadInput(
                f"--impl {spec} runs on CUDA rows only (CUDA C++, no interpreter): use --device cuda"
            )
        return [(spec, OURS[name])]
    if spec == "torch":
        return [("torch", torch_topk)]
    return [(spec, _import_function(spec))]


def conform(
    impls: list[tuple[str, TopK]],
    *,
    shapes: str = "small",
    device: str = "cpu",
    names: list[str] | None = None,
    seed: int = 0,
    on_case=None,
) -> dict:
    """Every case through every implementation -> the report (``REPORT_SCHEMA``). Each case is
    built once and run through all implementations before the next is built. ``on_case(impl
    name, CaseResult)`` is called after each run (progress)."""
    try:
        dev = torch.device(device)
        case_iter = cases(shapes, dev, names, seed)
        first = next(case_iter, None)
    except (ValueError, RuntimeError) as e:
        raise BadInput(str(e)) from None
    results: dict[str, list] = {name: [] for name, _ in impls}
    case = first
    while case is not None:
        exp = expected(case)
        for name, fn in impls:
            res = run_case(fn, case, exp)
            results[name].append(dataclasses.asdict(res))
            if on_case is not None:
                on_case(name, res)
        case = next(case_iter, None)
    triton_spec = importlib.util.find_spec("triton")
    return {
        "shapes": shapes,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "seed": seed,
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__ if triton_spec else None,
        "impls": [
            {
                "impl": name,
                "exact": all(c["exact"] for c in rs),
                "wrote_inputs": [c["name"] for c in rs if c["inputs_written"]],
                "cases": rs,
            }
            for name, rs in results.items()
        ],
    }
