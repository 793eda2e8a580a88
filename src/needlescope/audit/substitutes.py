"""Reduced-precision or rewritten ops substituted into a loaded DeepSeek-V4 model (instances
only; each returns its undo). They are what a speed patch does, so the audit can measure them
op by op and compounded, and a ledger's patch file can apply one (``apply(model)`` returning
``hc_mix_bf16(model)``).

* ``hc_mix_bf16``: the hyper-connection mixing GEMM (``fn`` over the normed, flattened
  streams) with inputs and weights rounded to bf16, as a bf16 GEMM with fp32 accumulation.
* ``routed_scale_twice``: the routed-expert weights multiplied by ``routed_scaling_factor``
  once more (a rewrite that applies it in the router and again on the output).
* ``attn_out_bf16``: every attention output rounded to bf16 (a split-K decode kernel that
  merges its partial results in bf16; applied at every query position so that one prefill
  measures what each decode step would see).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["SUBSTITUTES", "hc_mix_bf16", "routed_scale_twice", "attn_out_bf16", "hc_modules"]


def hc_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every hyper-connection mixing module."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "DeepseekV4HyperConnection"]


_LINEAR = F.linear


def _bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # bf16 operands, fp32 accumulation (what a bf16 tensor-core GEMM does).
    return _LINEAR(x.bfloat16().float(), w.bfloat16().float(), bias)


def hc_mix_bf16(model: torch.nn.Module) -> Callable[[], None]:
    """Round the hyper-connection GEMM's operands to bf16 in every layer; returns the undo."""
    undo = []
    for _, mod in hc_modules(model):
        original = type(mod).forward

        def forward(hidden_streams, _m=mod, _orig=original):
            try:
                # The mixing GEMM is the only F.linear call of this forward.
                F.linear = _bf16_linear
                return _orig(_m, hidden_streams)
            finally:
                F.linear = _LINEAR

        mod.forward = forward
        undo.append(mod)
    return _restorer(undo)


def _restorer(mods: list[torch.nn.Module]) -> Callable[[], None]:
    """The undo of instance-level ``forward`` overrides on ``mods``."""

    def restore() -> None:
        for mod in mods:
            mod.__dict__.pop("forward", None)

    return restore


def routed_scale_twice(model: torch.nn.Module) -> Callable[[], None]:
    """Apply ``routed_scaling_factor`` a second time to the routed weights; returns the undo."""
    undo = []
    for _, mod in model.named_modules():
        if type(mod).__name__ not in ("DeepseekV4TopKRouter", "DeepseekV4HashRouter"):
            continue
        original = mod.forward

        def forward(*args, _orig=original, _m=mod, **kwargs):
            logits, weights, indices = _orig(*args, **kwargs)
            return logits, weights * _m.routed_scaling_factor, indices

        mod.forward = forward
        undo.append(mod)
    return _restorer(undo)


def attn_out_bf16(model: torch.nn.Module) -> Callable[[], None]:
    """Round every attention block's output to bf16; returns the undo."""
    handles = []
    for _, mod in model.named_modules():
        if type(mod).__name__ == "DeepseekV4Attention":

            def hook(module, args, output):
                out, weights = output
                return out.bfloat16().to(out.dtype), weights

            handles.append(mod.register_forward_hook(hook))

    def restore() -> None:
        for h in handles:
            h.remove()

    return restore


SUBSTITUTES: dict[str, Callable[[torch.nn.Module], Callable[[], None]]] = {
    "hc_mix_bf16": hc_mix_bf16,
    "routed_scale_twice": routed_scale_twice,
    "attn_out_bf16": attn_out_bf16,
}
