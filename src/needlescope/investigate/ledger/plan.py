"""The configurations an investigation measures: a ``Config`` is a ``Setting`` (numerics plus at
most one indexer patch, applied by ``needlescope.dsa.emulate``) plus extra patch files applied
around it (model-level patches such as a bf16 hyper-connection GEMM; they must not wrap the
indexer scorer, whose forward ``emulate`` owns). Torch-free: a value, applied by
``measure.records.applied``.
"""

from __future__ import annotations

from dataclasses import dataclass

from needlescope.setting import PatchRef, Setting

__all__ = ["Config"]


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
