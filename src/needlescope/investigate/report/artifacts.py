"""Machine-independent paths in an investigation's artifacts.

* ``relativize(obj, prefixes)``: every string of a JSON object with each absolute prefix replaced
  (the ledger's directory by nothing, so patch files and env files read as the ledger names them;
  the checkpoint's directory by the checkpoint's name). ``verdicts.json``, ``investigation.json``,
  ``state.json`` and the reports rendered from them carry no absolute path of the machine.
"""

from __future__ import annotations

__all__ = ["relativize"]


def relativize(obj, prefixes: dict[str, str]):
    """``obj`` with every string's absolute ``prefixes`` (longest first) replaced by their values."""
    order = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))

    def fix(x):
        if isinstance(x, str):
            for old, new in order:
                if old in x:
                    x = x.replace(old, new)
            return x
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fix(v) for v in x]
        return x

    return fix(obj)
