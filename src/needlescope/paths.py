"""Files the user points at: output directories and JSON config files, checked before any work.

Torch-free and without side effects: ``check_out_dir`` only inspects the filesystem, and
``read_json_object`` is the one reader of a JSON config a user hands in (a checkpoint's
``config.json``, a tokenizer's ``tokenizer_config.json``), so each refuses a broken file the same way.
State and lock files in an ``--out`` folder are opened with ``open_nofollow`` (or checked with
``refuse_links`` before a library opens them) and deleted with ``unlink_own``: a symbolic link a
user or another process put at their name is never written through or deleted.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

from needlescope.errors import BadInput

__all__ = [
    "atomic_write_json",
    "check_out_dir",
    "open_nofollow",
    "read_json_object",
    "refuse_links",
    "relativize",
    "unlink_own",
]


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


def read_json_object(path: str | Path, hint: str) -> dict:
    """The JSON object in ``path``; BadInput (``hint`` says what to do) when it is unreadable,
    not JSON, or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} is not readable JSON ({exc}); {hint}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path} is not a JSON object; {hint}")
    return data


def json_safe(obj):
    """``obj`` with every non-finite float written as a string (``"nan"``, ``"inf"``, ``"-inf"``):
    strict JSON, which jq and JavaScript read (Python's ``NaN``/``Infinity`` they refuse). A
    reader maps the strings back where its schema says a number may be non-finite."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def from_json_safe(value):
    """Inverse of ``json_safe`` for one value a schema says is a number: its strings as floats."""
    return float(value) if value in ("nan", "inf", "-inf") else value


def atomic_write_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` through a synced temporary file and a rename, so a crash
    leaves either the old file or the new one, never half of one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _link_refused(path: Path) -> BadInput:
    return BadInput(
        f"{path} is a symbolic link; needlescope never writes its state through a link "
        "(it could point outside the folder): remove the link or choose another --out"
    )


def open_nofollow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW, mode)``: a state or lock file is never written through a
    symbolic link planted at its name (it could point anywhere outside ``--out``); such a link is
    refused, BadInput in one line, and left as it is."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_refused(Path(path)) from None
        raise


def refuse_links(*paths: str | Path) -> None:
    """BadInput (one line) naming the first of ``paths`` that is a symbolic link, dangling or not:
    for files a library opens itself (SQLite follows links), checked before it opens them."""
    for path in paths:
        if Path(path).is_symlink():
            raise _link_refused(Path(path))


def unlink_own(path: str | Path, fd: int) -> None:
    """Delete ``path`` only while it still names the file open at ``fd``: never a link or another
    file put there since (a lock's holder deletes its lock file, and nothing else, as it lets go)."""
    try:
        here = os.lstat(path)
    except FileNotFoundError:
        return
    mine = os.fstat(fd)
    if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
        os.unlink(path)


def relativize(obj, prefixes: dict[str, str]):
    """``obj`` (a JSON value) with every string's absolute ``prefixes`` (longest first) replaced by
    their values: an artifact names no absolute path of the machine that wrote it (an
    investigation maps the ledger's directory to nothing and the checkpoint's to its name)."""
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
