"""Built-in indexer faults: patch files that reproduce bugs a fast indexer kernel can have.

Each module here is an ordinary ``--patch`` file (it defines ``apply(model)`` and returns the
undo), shipped so that a fault can be rehearsed end to end: serve the organism with one, probe
it, and check that ``needlescope indexer rank`` / ``diff`` point at it. Name one anywhere a
patch file is accepted as ``fault:NAME``, e.g. ``needlescope serve --patch fault:indexer_key_slot``.
Names resolve through ``needlescope.setting.PatchRef`` (the one place that knows them).

Measured on the organism at fp8 keys and ``index_topk`` 64 (docs/faults.md): multiturn recall
at 4K falls from 0.99 to 0.14 under ``indexer_page_table`` and to 0.53 under
``indexer_key_slot``; ``indexer_key_positions`` and ``indexer_fp8_no_scale`` leave it unchanged.
"""

from __future__ import annotations

from pathlib import Path

from needlescope.setting import FAULT_PREFIX, PatchRef, fault_names

__all__ = ["FAULT_PREFIX", "fault_names", "resolve_patch"]


def resolve_patch(spec: str | Path) -> Path:
    """The patch file that ``spec`` names: ``fault:NAME`` for a built-in, else a path.

    Raises BadInput for an unknown fault name or a path that is not a file.
    """
    return PatchRef.resolve(spec).path
