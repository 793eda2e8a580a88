"""An exact undo for a patch that returns none: the model restored from a pristine copy.

Most monkeypatches replace a module's ``forward`` (or a class's, or a function of the
modeling file), change a weight in place, and return nothing. Such a patch changes the model
for good; applied twice it compounds. ``PristineCopy.take(model)`` keeps, before the patch
runs, what it can change:

* every module's instance state (its ``__dict__`` and the dicts of parameters, buffers,
  sub-modules and hooks, one level deep: a replaced ``forward`` or a swapped sub-module);
* every parameter's and buffer's values (cloned; on the CPU for a model on an accelerator,
  which bounds the copy by host memory, not by the accelerator's);
* the attributes of the model's module classes and the globals of the files that define them
  (a patch that replaces ``DeepseekV4Indexer.forward`` or ``apply_rotary_pos_emb``), and of
  ``torch.Tensor`` and its C base (``Tensor.topk = dropping_topk``: an added attribute that
  shadows an inherited one is deleted again);
* the contents of those files' mappings (``ALL_ATTENTION_FUNCTIONS["sdpa"] = bad``, a registry
  the modeling file reads at every forward);
* the model's ``config`` and ``generation_config`` (``model.config.sliding_window = 8``: every
  forward reads it for its mask and cache).

``restore()`` puts all of it back, so the model is the one loaded, bit for bit (tested against
a fresh load), at the cost of one copy of its weights. A fresh load is never cheaper: it reads
the same weights from disk (the organism: 0.1 s warm, 3 s cold, against 0.01 s to clone).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch

__all__ = ["PristineCopy", "weight_bytes"]

_DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (what a pristine copy holds)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def copyable(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer holds data: a streamed model's layers live on the meta
    device between passes (``dsa.streaming``), and a copy of those would hold nothing."""
    return not any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _classes(model: torch.nn.Module) -> list[type]:
    """The module classes of ``model`` and their module bases (``torch.nn.Module`` included),
    each once, plus ``torch.Tensor`` and its C base (a patch may replace ``Tensor.topk``)."""
    seen: dict[type, None] = {torch.Tensor: None, torch._C.TensorBase: None}
    for mod in model.modules():
        for cls in type(mod).__mro__:
            if issubclass(cls, torch.nn.Module):
                seen.setdefault(cls, None)
    return list(seen)


def _restore_class(cls: type, saved: dict) -> None:
    """Set every attribute of ``cls`` back to ``saved`` (a copy of its ``__dict__``); delete added
    ones (of torch's own classes only those that shadow an inherited attribute, a patch's
    override: torch may add others lazily)."""
    now = dict(vars(cls))
    ours = not cls.__module__.startswith("torch")
    for name in now.keys() - saved.keys():
        if ours or any(name in vars(base) for base in cls.__mro__[1:]):
            delattr(cls, name)
    for name, value in saved.items():
        if now.get(name, _MISSING) is not value:
            setattr(cls, name, value)


def _restore_globals(namespace: dict, saved: dict) -> None:
    """Set back every global of a file that changed (added ones stay: a lazy import may add some)."""
    for name, value in saved.items():
        if namespace.get(name, _MISSING) is not value:
            namespace[name] = value


_MISSING = object()


def _mappings(namespace: dict) -> list[dict]:
    """The mutable mappings a file's globals hold, each once: plain dicts (and their subclasses)
    and transformers' registries (``GeneralInterface``: a per-instance and a class-wide dict)."""
    found: dict[int, dict] = {}
    for value in list(namespace.values()):
        if isinstance(value, dict):
            found.setdefault(id(value), value)
        for name in ("_local_mapping", "_global_mapping"):
            inner = getattr(value, name, None) if not isinstance(value, type) else None
            if isinstance(inner, dict):
                found.setdefault(id(inner), inner)
    return list(found.values())


def _stored(mapping: dict) -> dict:
    """The values ``mapping`` stores, read past any ``__getitem__`` of its class (transformers'
    ``ACT2FN`` builds a new module on every read: a copy through it would store modules)."""
    return {k: dict.__getitem__(mapping, k) for k in dict.keys(mapping)}


def _restore_config(now: dict, saved: dict) -> None:
    """A config's ``__dict__`` back to ``saved`` (a deep copy), in place (the object stays the one
    every module holds) and value by value: an unchanged value keeps its identity."""
    for key in now.keys() - saved.keys():
        del now[key]
    for key, value in saved.items():
        if key not in now or not _equal(now[key], value):
            now[key] = copy.deepcopy(value)


def _equal(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # no plain equality (a tensor, an array): put the copy back
        return False


def _configs(model: torch.nn.Module) -> list[object]:
    """The config objects the model's modules hold (``config``, ``generation_config``), each once."""
    found: dict[int, object] = {}
    for mod in model.modules():
        for name in ("config", "generation_config"):
            cfg = mod.__dict__.get(name)
            if cfg is not None and hasattr(cfg, "__dict__") and not isinstance(cfg, (torch.nn.Module, type)):
                found.setdefault(id(cfg), cfg)
    return list(found.values())


@dataclass
class PristineCopy:
    """What a patch may change in a model, kept before it runs (``take``), put back by ``restore``."""

    modules: list[tuple[torch.nn.Module, dict, dict]]  # (module, instance dict, its inner dicts)
    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live parameter or buffer, its clone)
    classes: list[tuple[type, dict]]
    module_globals: list[tuple[dict, dict]]  # (a modeling file's globals, their copy)
    mappings: list[tuple[dict, dict]]  # (a mapping a modeling file holds, its shallow copy)
    configs: list[tuple[object, dict]]  # (a config object, a deep copy of its __dict__)

    @classmethod
    def take(cls, model: torch.nn.Module) -> PristineCopy:
        modules = []
        for mod in model.modules():
            inner = {k: copy.copy(mod.__dict__[k]) for k in _DICTS if k in mod.__dict__}
            modules.append((mod, dict(mod.__dict__), inner))
        seen: set[int] = set()
        tensors = []
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in seen:  # tied weights are one tensor
                seen.add(id(t))
                tensors.append((t, t.detach().to("cpu", copy=True)))
        classes = _classes(model)
        files = {cls.__module__ for cls in classes} | {"torch", "torch.nn.functional"}
        module_globals = [
            (vars(sys.modules[f]), dict(vars(sys.modules[f]))) for f in sorted(files & sys.modules.keys())
        ]
        # torch's own files keep caches in their dicts: only the modeling files' mappings are kept
        mappings = {
            id(m): (m, _stored(m))
            for namespace, _ in module_globals
            if not namespace.get("__name__", "").startswith("torch")
            for m in _mappings(namespace)
        }
        configs = [(c, copy.deepcopy(vars(c))) for c in _configs(model)]
        return cls(
            modules,
            tensors,
            [(c, dict(vars(c))) for c in classes],
            module_globals,
            list(mappings.values()),
            configs,
        )

    def restore(self) -> None:
        """Put back every module's state, every tensor's values, the classes, the files' globals and
        mappings, and the configs."""
        for namespace, saved in self.module_globals:
            _restore_globals(namespace, saved)
        for live, saved in self.mappings:  # in place: every file holding it sees the same object
            if dict.keys(live) != saved.keys() or any(
                dict.__getitem__(live, k) is not v for k, v in saved.items()
            ):
                live.clear()
                live.update(saved)
        for cfg, saved in self.configs:
            _restore_config(vars(cfg), saved)
        for cls, saved in self.classes:
            _restore_class(cls, saved)
        for mod, saved, inner in self.modules:
            mod.__dict__.clear()
            mod.__dict__.update(saved)
            for k, d in inner.items():  # in place: a hook's RemovableHandle holds its dict
                live = mod.__dict__[k]
                live.clear()
                live.update(d)
        with torch.no_grad():
            for live, kept in self.tensors:
                if live.shape == kept.shape and live.dtype == kept.dtype:
                    live.copy_(kept)
                else:  # the patch swapped the storage for another shape or dtype
                    live.data = kept.to(live.device)
