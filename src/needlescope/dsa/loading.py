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

from needlescope.dsa.blockfp4 import dequantize_block_fp4, is_packed_fp4
from needlescope.dsa.blockfp8 import dequantize_block_fp8
from needlescope.dsa.consistency import check_checkpoint
from needlescope.dsa.placement import (
    Placement,
    default_budget,
    parse_max_memory,
)
from needlescope.dsa.release import SCALE_SUFFIX, expert_slot, hf_name
from needlescope.errors import BadInput
from needlescope.paths import read_json_object

__all__ = [
    "TensorReader",
    "checkpoint_tensors",
    "empty_model",
    "fill",
    "load_placed",
    "model_config",
    "model_tensors",
    "placement_of",
    "set_tensor",
    "planned",
    "read_group",
    "stored_names",
]

_PLACEMENT_ATTR = "needlescope_placement"


def _shard_keys(f: Path) -> list[str]:
    """The tensor names in one safetensors file's header; BadInput when it is unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(f, framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise BadInput(
            f"{str(f)!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
            "re-copy or re-save the checkpoint"
        ) from None


def _index_map(path: Path, index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name), checked to be one."""
    raw = read_json_object(index, "restore the checkpoint's model.safetensors.index.json").get("weight_map")
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise BadInput(f"{index}: 'weight_map' is not an object of tensor name -> shard file name")
    for file in sorted(set(raw.values())):
        # A shard is a file of the checkpoint directory itself: an index naming one elsewhere
        # ('../x', '/abs') would load weights nobody checked.
        if Path(file).name != file or not (path / file).is_file():
            raise BadInput(
                f"{index} names the shard {file!r}, which is not a file in {str(path)!r}; "
                "copy the missing shard or restore the index"
            )
    return raw


def checkpoint_tensors(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index when there is one, else the headers).

    BadInput, before any tensor is read, when the index is not JSON, names a shard that is not in
    the directory or a tensor its shard does not hold, or when two shards without an index hold
    one name (which copy is meant cannot be told).
    """
    index = path / "model.safetensors.index.json"
    out: dict[str, Path] = {}
    if index.is_file():
        weight_map = _index_map(path, index)
        held = {file: set(_shard_keys(path / file)) for file in set(weight_map.values())}
        absent = [n for n, file in weight_map.items() if n not in held[file]]
        if absent:
            raise BadInput(
                f"{index} places {len(absent)} tensor(s) in shards that do not hold them, e.g. "
                f"{absent[0]!r} in {weight_map[absent[0]]!r}; restore the index the shards were saved with"
            )
        return {name: path / file for name, file in weight_map.items()}
    for f in sorted(path.glob("*.safetensors")):
        for name in _shard_keys(f):
            if name in out:
                raise BadInput(
                    f"{str(path)!r}: tensor {name!r} is in both {out[name].name!r} and {f.name!r} and there is "
                    "no model.safetensors.index.json to say which is meant; remove the stray shard"
                )
            out[name] = f
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
                set_tensor(model, name, torch.empty(t.shape, dtype=torch.float32, device=t.device))
    return model


def set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """Put ``value`` in place of the parameter or buffer ``name``; returns what the model now holds."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
        return module._parameters[leaf]
    module._buffers[leaf] = value
    return value


def _unit_of(name: str, placement: Placement) -> str:
    parts = name.split(".")
    for k in (3, 2, 1):
        prefix = ".".join(parts[:k])
        if prefix in placement.units:
            return prefix
    raise BadInput(f"checkpoint tensor {name!r} belongs to no placement unit")


class TensorReader:
    """Reads checkpoint tensors by name from their safetensors files (memory-mapped, opened once)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored, on the CPU (this copy is the disk read)."""
        from safetensors import safe_open

        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt", device="cpu")
        return self._handles[f].get_tensor(name)


def stored_names(files: dict[str, Path]) -> list[str]:
    """The checkpoint tensors that load as one model tensor each: every name but a weight's ``.scale``."""
    return [
        n
        for n in files
        if not (n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) + ".weight" in files)
    ]


def read_group(get, files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` and their ``.scale`` tensors, as stored, read through ``get`` (CPU tensors)."""
    out = {}
    for name in names:
        out[name] = get(name)
        scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
        if name.endswith(".weight") and scale_name in files:
            out[scale_name] = get(scale_name)
    return out


def _decoded(raw: dict[str, torch.Tensor], name: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``name`` of ``raw`` on ``device``: dequantized to ``dtype`` when a ``.scale`` sits beside
    it (packed fp4 for int8 weights, block fp8 otherwise)."""
    t = raw[name].to(device)
    scale = raw.get(name.removesuffix(".weight") + SCALE_SUFFIX) if name.endswith(".weight") else None
    if scale is None:
        return t
    if is_packed_fp4(t):
        return dequantize_block_fp4(t, scale.to(device), dtype=dtype)
    return dequantize_block_fp8(t, scale.to(device), dtype=dtype)


def fill(
    model: torch.nn.Module,
    raw: dict[str, torch.Tensor],
    names: list[str],
    device_of,
    dtype: torch.dtype,
    targets: dict[str, torch.Tensor],
    filled: set[str],
) -> list[str]:
    """Set the model tensors of checkpoint tensors ``names`` (read into ``raw``); returns the names the
    model does not have. ``device_of(target)`` gives each model tensor's device; ``targets`` (model
    path -> tensor) is updated as stacked expert parameters are created; ``filled`` collects the paths set.
    """
    intermediate = int(model.config.moe_intermediate_size)
    unexpected = []
    for name in names:
        slot = expert_slot(name, intermediate)
        target = slot.param if slot is not None else hf_name(name)
        if target is None:  # the release's MTP block: transformers does not load it
            continue
        if target not in targets:
            unexpected.append(name)
            continue
        ref = targets[target]
        device = device_of(target)
        value = _decoded(raw, name, device, ref.dtype if ref.is_floating_point() else dtype)
        if slot is None:
            value = value.to(ref.dtype)
            if tuple(value.shape) != tuple(ref.shape):
                raise BadInput(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, the model wants {tuple(ref.shape)}"
                )
            set_tensor(model, target, value)
        else:
            if target not in filled:
                set_tensor(model, target, torch.empty(ref.shape, dtype=ref.dtype, device=device))
                targets[target] = model.get_parameter(target)
            dest = targets[target][slot.expert]
            (dest if slot.rows is None else dest[slot.rows]).copy_(value)
        filled.add(target)
    return unexpected


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Model path -> parameter or persistent buffer: what a checkpoint fills."""
    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if n in model.state_dict()})
    return targets


def load_placed(
    path: Path, placement: Placement, model: torch.nn.Module, dtype: torch.dtype
) -> torch.nn.Module:
    """Fill the meta-device ``model`` from the checkpoint at ``path`` according to ``placement``."""
    files = checkpoint_tensors(path)
    targets = model_tensors(model)
    device_map = placement.device_map()
    reader = TensorReader(files)
    filled: set[str] = set()
    unexpected = []
    for name in stored_names(files):
        raw = read_group(reader.get, files, [name])
        unexpected += fill(
            model, raw, [name], lambda t: device_map[_unit_of(t, placement)], dtype, targets, filled
        )
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


def planned(
    path: Path, devices: list[str], max_memory: str | None, reserve: int, dtype: torch.dtype | None
) -> tuple[torch.nn.Module, list[int | None], torch.dtype]:
    """(model on the meta device, weight budget per device, dtype): what placing or streaming starts from.

    ``dtype``: None takes the checkpoint's own (``config.json`` ``dtype`` / ``torch_dtype``).
    ``config.json`` is checked against the weights first (``check_checkpoint``), as for ``from_pretrained``.
    """
    check_checkpoint(path, checkpoint_tensors(path))
    config = model_config(path, torch.float32)
    if dtype is None:
        dtype = _config_dtype(path)
    config.dtype = dtype
    model = empty_model(config, dtype)
    budgets = parse_max_memory(max_memory, len(devices))
    budgets = [b if b is not None else default_budget(d, reserve) for d, b in zip(devices, budgets)]
    return model, budgets, dtype


def _config_dtype(path: Path) -> torch.dtype:
    cfg = json.loads((path / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise BadInput(f"{path}/config.json names dtype {name!r}, which is not a torch dtype")
    return dtype
