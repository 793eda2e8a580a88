"""The configurations an investigation measures: a ``Config`` is a ``Setting`` (numerics plus at
most one indexer patch, applied by ``needlescope.dsa.emulate``) plus extra patch files applied
around it (model-level patches such as a bf16 hyper-connection GEMM; they must not wrap the
indexer scorer, whose forward ``emulate`` owns). Torch-free: a value, applied by
``measure.records.applied``. ``removal`` and ``addition`` are the ablation plan: a suspect taken
out of a configuration, or added alone to one.
"""

from __future__ import annotations

from dataclasses import dataclass

from needlescope.investigate.ledger.ledger import Suspect
from needlescope.setting import PatchRef, Setting

__all__ = ["Config", "removal", "addition", "at_topk"]


@dataclass(frozen=True)
class Config:
    """A setting to measure plus extra (non-scorer) patches."""

    setting: Setting
    extra: tuple[PatchRef, ...] = ()

    def label(self) -> str:
        return self.setting.label() + "".join(f" +{p.spec}" for p in self.extra)

    def to_json(self) -> dict:
        return {
            "setting": self.setting.to_json(),
            "extra_patches": [p.spec for p in self.extra],
            "label": self.label(),
        }


def removal(s: Suspect, base: Config, reference: Setting) -> Config:
    """``base`` with ``s`` taken out: its patch dropped, or its setting fields back to ``reference``'s."""
    if s.patch is not None:
        if base.setting.patch is not None and base.setting.patch.path == s.patch.path:
            return Config(base.setting.with_(patch=None), base.extra)
        return Config(base.setting, tuple(p for p in base.extra if p.path != s.patch.path))
    return Config(base.setting.with_(**{f: getattr(reference, f) for f, _ in s.setting_fields}), base.extra)


def addition(s: Suspect, base: Config, candidate: Config | None) -> Config:
    """``base`` with ``s`` added alone. A patch that is a built-in fault or the ``candidate``'s own
    indexer patch becomes ``base``'s indexer patch (when it has none); any other is an extra patch."""
    if s.patch is not None:
        cand_patch = candidate.setting.patch if candidate is not None else None
        indexer_patch = s.patch.is_fault or (cand_patch is not None and cand_patch.path == s.patch.path)
        if indexer_patch and base.setting.patch is None:
            return Config(base.setting.with_(patch=s.patch), base.extra)
        return Config(base.setting, (*base.extra, s.patch))
    return Config(base.setting.with_(**dict(s.setting_fields)), base.extra)


def at_topk(config: Config, k: int) -> Config:
    """``config`` at ``index_topk`` ``k`` (``config`` itself when it already is)."""
    return (
        config if config.setting.index_topk == k else Config(config.setting.with_(index_topk=k), config.extra)
    )
