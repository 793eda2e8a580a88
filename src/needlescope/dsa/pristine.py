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
  (a patch that replaces ``DeepseekV4Indexer.forward`` or ``apply_rotary_pos_emb``).

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
    each once, plus ``torch.Tensor`` (a patch may replace ``Tensor.topk``)."""
    seen: dict[type, None] = {torch.Tensor: None}
    for mod in model.modules():
        for cls in type(mod).__mro__:
            if issubclass(cls, torch.nn.Module):
                seen.setdefault(cls, None)
    return list(seen)


def _restore_class(cls: type, saved: dict) -> None:
    """Set every attribute of ``cls`` back to ``saved`` (a copy of its ``__dict__``); delete added ones."""
    now = dict(vars(cls))
    if not cls.__module__.startswith("torch"):  # torch's own classes: only what changed
        for name in now.keys() - saved.keys():
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


@dataclass
class PristineCopy:
    """What a patch may change in a model, kept before it runs (``take``), put back by ``restore``."""

    modules: list[tuple[torch.nn.Module, dict, dict]]  # (module, instance dict, its inner dicts)
    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live parameter or buffer, its clone)
    classes: list[tuple[type, dict]]
    module_globals: list[tuple[dict, dict]]  # (a modeling file's globals, their copy)

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
        return cls(modules, tensors, [(c, dict(vars(c))) for c in classes], module_globals)

    def restore(self) -> None:
        """Put back every module's state, every tensor's values, the classes and the files' globals."""
        for namespace, saved in self.module_globals:
            _restore_globals(namespace, saved)
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
