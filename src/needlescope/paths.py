"""Output directories: checked before any model or network work, so a bad ``--out`` costs nothing.

Torch-free and without side effects: ``check_out_dir`` only inspects the filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path

from needlescope.errors import BadInput

__all__ = ["check_out_dir"]


def check_out_dir(out: str | Path, flag: str = "--out") -> Path:
    """``out`` as a Path if it is a writable directory or can be created as one; BadInput otherwise.

    Refused: an existing file (or anything that is not a directory), a directory without write
    permission, and a path whose nearest existing ancestor is not a writable directory.
    """
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            raise BadInput(f"{flag} {str(out)!r} exists and is not a directory; choose another path")
        if not os.access(path, os.W_OK | os.X_OK):
            raise BadInput(f"{flag} {str(out)!r} is not writable; choose another directory")
        return path
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {str(out)!r} cannot be created: {str(parent)!r} is not a writable directory")
    return path
