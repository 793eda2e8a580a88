"""Load a DeepSeek-V4 checkpoint (transformers layout or DeepSeek's release layout, bf16 or block
fp8) onto a ``Placement``: one device or several.

Each safetensors tensor is read once, memory-mapped, moved to the device of the unit that owns it,
dequantized there when it is block fp8 (``weight`` e4m3 + ``scale`` e8m0/fp32), renamed to the
transformers path (``dsa.release``) and set into a model built on the meta device; routed experts
are copied into their stacked parameter expert by expert, so peak host memory is one tensor.
Tensors the model does not have, and model tensors the checkpoint lacks, are BadInput.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from needlescope.dsa.blockfp8 import dequantize_block_fp8
from needlescope.dsa.placement import (
    DEFAULT_RESERVE,
    Placement,
    default_budget,
    parse_max_memory,
    plan_placement,
    unit_bytes,
)
from needlescope.dsa.release import SCALE_SUFFIX, expert_slot, hf_name
from needlescope.errors import BadInput

__all__ = ["checkpoint_tensors", "empty_model", "load_placed", "load_sharded", "model_config", "placement_of"]

_PLACEMENT_ATTR = "needlescope_placement"


def checkpoint_tensors(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index when there is one, else the headers)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: path / file for name, file in weight_map.items()}
    out: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as handle:
            out.update(dict.fromkeys(handle.keys(), f))
    return out


def model_config(path: Path, dtype: torch.dtype):
    """The transformers config of ``path`` without its ``quantization_config`` (we dequantize ourselves)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.dtype = dtype
    return config


def empty_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The model with parameters on the meta device (buffers real, on the CPU), eager attention.

    Parameters of transformers' ``_keep_in_fp32_modules_strict`` (norms, hyper-connections,
    sinks, position biases, router bias) stay float32, as ``from_pretrained`` keeps them.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype != torch.float32:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and keep & set(name.split(".")):
                _set(model, name, torch.empty(t.shape, dtype=torch.float32, device=t.device))
    return model


def _set(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _unit_of(name: str, placement: Placement) -> str:
    parts = name.split(".")
    for k in (3, 2, 1):
        prefix = ".".join(parts[:k])
        if prefix in placement.units:
            return prefix
    raise BadInput(f"checkpoint tensor {name!r} belongs to no placement unit")


def _read(handles, files: dict[str, Path], name: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``name`` on ``device``: dequantized to ``dtype`` when a ``.scale`` sits beside it."""
    from safetensors import safe_open

    def get(n: str) -> torch.Tensor:
        f = files[n]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt", device="cpu")
        return handles[f].get_tensor(n).to(device)

    t = get(name)
    scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
    if name.endswith(".weight") and scale_name in files:
        return dequantize_block_fp8(t, get(scale_name), dtype=dtype)
    return t


def load_placed(
    path: Path, placement: Placement, model: torch.nn.Module, dtype: torch.dtype
) -> torch.nn.Module:
    """Fill the meta-device ``model`` from the checkpoint at ``path`` according to ``placement``."""
    files = checkpoint_tensors(path)
    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if n in model.state_dict()})
    device_of = placement.device_map()
    intermediate = int(model.config.moe_intermediate_size)
    handles: dict[Path, object] = {}
    filled: set[str] = set()
    unexpected = []
    for name in files:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) + ".weight" in files:
            continue
        slot = expert_slot(name, intermediate)
        target = slot.param if slot is not None else hf_name(name)
        if target is None:  # the release's MTP block: transformers does not load it
            continue
        if target not in targets:
            unexpected.append(name)
            continue
        ref = targets[target]
        device = device_of[_unit_of(target, placement)]
        value = _read(handles, files, name, device, ref.dtype if ref.is_floating_point() else dtype)
        if slot is None:
            value = value.to(ref.dtype)
            if tuple(value.shape) != tuple(ref.shape):
                raise BadInput(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, the model wants {tuple(ref.shape)}"
                )
            _set(model, target, value)
        else:
            if target not in filled:
                _set(model, target, torch.empty(ref.shape, dtype=ref.dtype, device=device))
                targets[target] = model.get_parameter(target)
            dest = targets[target][slot.expert]
            (dest if slot.rows is None else dest[slot.rows]).copy_(value)
        filled.add(target)
    if unexpected:
        raise BadInput(
            f"{path}: {len(unexpected)} checkpoint tensors the model does not have, e.g. {unexpected[:3]}"
        )
    missing = sorted(set(targets) - filled)
    if missing:
        raise BadInput(f"{path}: the checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    return _dispatch(model, placement)


def _dispatch(model: torch.nn.Module, placement: Placement) -> torch.nn.Module:
    if len(set(placement.units.values())) == 1:
        model = model.to(placement.devices[next(iter(placement.units.values()))])
    else:
        from accelerate import dispatch_model

        model = dispatch_model(
            model,
            device_map=placement.device_map(),
            main_device=placement.devices[0],
            skip_keys=getattr(model, "_skip_keys_device_placement", None),
        )
    setattr(model, _PLACEMENT_ATTR, placement)
    return model.eval()


def placement_of(model: torch.nn.Module) -> Placement | None:
    """The ``Placement`` a model was loaded with (None: loaded by ``from_pretrained`` on one device)."""
    return getattr(model, _PLACEMENT_ATTR, None)


def load_sharded(
    path: Path,
    *,
    devices: list[str],
    max_memory: str | None,
    reserve: int = DEFAULT_RESERVE,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """Plan (refusing before any tensor is read when the weights do not fit) and load onto ``devices``.

    ``dtype``: None takes the checkpoint's own (``config.json`` ``dtype`` / ``torch_dtype``);
    block-fp8 weights dequantize to it.
    """
    config = model_config(path, torch.float32)
    if dtype is None:
        dtype = _config_dtype(path)
    config.dtype = dtype
    model = empty_model(config, dtype)
    budgets = parse_max_memory(max_memory, len(devices))
    budgets = [b if b is not None else default_budget(d, reserve) for d, b in zip(devices, budgets)]
    placement = plan_placement(unit_bytes(model), devices, budgets)
    return load_placed(path, placement, model, dtype)


def _config_dtype(path: Path) -> torch.dtype:
    cfg = json.loads((path / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise BadInput(f"{path}/config.json names dtype {name!r}, which is not a torch dtype")
    return dtype
