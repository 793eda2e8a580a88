"""Built-in serving faults: patch files that plant the bugs a serving layer can have.

Each module is an ordinary ``--patch`` file (``apply(model)`` returning its undo), named
``fault:NAME`` like the indexer faults of ``needlescope.dsa.faults``, but the bug lives in the
engine (scheduling, caches, speculative decoding), not in the model's math. The server never
names one (``ServeConfig.patch_shown``): it is planted like a bug nobody announced, and an
investigation has to find the serving factor that reproduces it. docs/faults.md lists where
each costs recall, with measurements.

A fault changes the engine that serves the model it was applied to, and no other engine in
the process (``patch_engine``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["patch_engine"]


def patch_engine(model, name: str, replacement: Callable) -> Callable[[], None]:
    """Replace ``Engine.<name>`` for the engine serving ``model``: ``replacement(original, engine,
    *args, **kwargs)`` runs instead; other engines keep the original. Returns the undo."""
    from needlescope.serve.engine import Engine

    original = getattr(Engine, name)

    def method(self, *args, **kwargs):
        if self.model is not model:
            return original(self, *args, **kwargs)
        return replacement(original, self, *args, **kwargs)

    setattr(Engine, name, method)

    def undo() -> None:
        setattr(Engine, name, original)

    return undo
