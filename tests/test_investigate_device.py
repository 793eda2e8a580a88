"""The GPU route stays working on a CPU-only machine: no measurement, audit or localizer step of
an investigation may hand the model a tensor it built on another device than the model's.

A CPU box has one device, so a mismatch cannot raise here. Instead a ``TorchFunctionMode``
tracks where tensors come from: every parameter and buffer of the model is *model-side*, and so
is anything computed from one; a tensor moved with an explicit device (``.to(dev)``) or built
with ``device=`` carries no mark (it was placed on purpose); a tensor that needlescope's own code builds with a factory and no ``device=`` (or moves with
``.cpu()``) is *host-side*. An operation that mixes the two (beyond 0-d scalars, which torch
moves itself) is exactly what raises "Expected all tensors to be on the same device" on a GPU
(issue 24: the audit built its probe ids on the CPU while the model was on cuda).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest

import needlescope

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

SRC = str(Path(needlescope.__file__).resolve().parent)
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.from_numpy,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
}


def _our_caller() -> str | None:
    """'file:line' of the first needlescope frame calling into torch, None when torch or a
    library (transformers) made the call."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(SRC):
            return f"{name[len(SRC) + 1 :]}:{f.f_lineno}"
        if "site-packages" in name and "/torch/" not in name:
            return None
        f = f.f_back
    return None


class DeviceTaint(TorchFunctionMode):
    def __init__(self, model):
        super().__init__()
        self.violations: list[str] = []
        for t in [*model.parameters(), *model.buffers()]:
            t._ns_side = "model"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = _tensors(args) + _tensors(kwargs.values())
        side = None
        if func in FACTORIES:
            if "device" not in kwargs:
                where = _our_caller()
                side = f"host@{where}" if where else None
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and (
            "device" in kwargs
            or any(isinstance(a, (str, torch.device)) for a in args[1:])
            or any(isinstance(a, torch.Tensor) for a in args[1:])
        ):
            # put on a device on purpose (whichever: on one CPU it cannot be told apart), so it
            # carries no host mark; a model-side tensor moved (or returned as is) stays model-side
            side = "model" if getattr(args[0], "_ns_side", None) == "model" else "moved"
        elif func is torch.Tensor.cpu:
            where = _our_caller()
            side = f"host@{where}" if where else None
        else:
            sides = {getattr(t, "_ns_side", None) for t in ins if t.dim() > 0}
            hosts = sorted(s for s in sides if s and s.startswith("host"))
            if "model" in sides and hosts:
                site = "".join(traceback.format_stack(limit=6)[:-1][-2:])
                self.violations.append(f"{func}: host tensor from {hosts[0]} meets the model's\n{site}")
            side = "model" if "model" in sides else (hosts[0] if hosts else None)
        if side is not None:
            for t in (
                [out]
                if isinstance(out, torch.Tensor)
                else _tensors(out if isinstance(out, (tuple, list)) else ())
            ):
                try:
                    t._ns_side = side
                except (AttributeError, RuntimeError):
                    pass
        return out


def _tensors(xs) -> list:
    """The tensors among ``xs`` and one level of lists or tuples inside it (how torch ops take them)."""
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(t for t in x if isinstance(t, torch.Tensor))
    return out


LEDGER = """
[target]
model = "organism"
threads = 2
reference = "k=fp32 q=fp32 acc=fp32 topk=16"
candidate = "k=fp32 q=fp32 acc=fp32 topk=16"
extra_patches = ["drop.py"]

[symptom]
kind = "multiturn"
lengths = [256]
depths = [15, 25, 35, 45, 55, 65, 75]
trials = 2
max_new_tokens = 3

[[suspects]]
id = "index_keys_fp8"
tier = 1
hypothesis = "fp8 keys (absent; its audits run)"
setting = "k=fp8_e4m3"
checks = ["audit:index_keys_fp8", "audit:index_topk"]

[[suspects]]
id = "drop"
tier = 2
hypothesis = "the candidate buffer (named, no causal check: it stays unexplained)"
patch = "drop.py"
checks = []
"""

DROP = """
from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, kv, hs):
            s = inner(q, kv, hs)
            s[..., 8:] = float("-inf")  # drops every candidate past a buffer of 8 entries
            return s
        return forward
    return wrap_scorers(model, wrap)
"""


def test_investigation_builds_no_tensor_off_the_models_device(tmp_path):
    """Audits, ablations, fixes, the residual and the localizer step, under the device taint."""
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.investigate.run import run_investigation

    (tmp_path / "investigation.toml").write_text(LEDGER)
    (tmp_path / "drop.py").write_text(DROP)
    model, tok, _ = load_bundle("organism")
    mode = DeviceTaint(model)
    with mode:
        run_investigation(tmp_path / "investigation.toml", tmp_path / "out", loaded=(model, tok))
    v = json.loads((tmp_path / "out" / "verdicts.json").read_text())
    audits = [e for s in v["suspects"] for e in s["evidence"] if e["check"].startswith("audit:")]
    assert audits, "the audits did not run"
    # the buffer suspect has no causal check, so nothing is implicated: the whole candidate is
    # the residual, it loses, and the localizer step (prefill and decode paths) runs too
    assert v["residual"]["loses"] and v["localization"] is not None, v["residual"]
    assert not mode.violations, mode.violations[0]


def test_the_taint_catches_ids_built_without_the_models_device():
    """The check itself: today's bug (ids built on the host, handed to the model) is caught."""
    from needlescope.dsa.checkpoint import load_bundle

    model, _, _ = load_bundle("organism")
    mode = DeviceTaint(model)
    with mode, torch.no_grad():
        ids = _build_ids_like_the_old_audit()
        model(ids, use_cache=False)
    assert mode.violations and "host tensor" in mode.violations[0]


def _build_ids_like_the_old_audit():
    # Not in needlescope's source tree, so tag it by hand the way a needlescope call site is.
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    ids._ns_side = "host@runner.py (old audit)"
    return ids
