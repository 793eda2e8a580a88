"""What a command wrote into its output directory, so that a rerun deletes exactly that.

A command that replaces its own earlier output (the demo) must never delete a directory by the
look of its names: a folder holding ``reference/`` and ``DIAGNOSIS.md`` may be someone's work.
``Manifest`` records every file the command wrote under ``out`` (relative path, size, SHA-256)
in ``out/MANIFEST_NAME``. ``clear`` deletes those files, and only while each still has the
recorded content, then the directories left empty; it refuses (BadInput, nothing deleted) when
``out`` holds anything else: a file the manifest does not list, or one changed since.

The command calls ``record`` at each step and once more however it ends (``finally``), so only a
SIGKILL mid-step leaves files unrecorded; a rerun then names them and deletes nothing.

``--force`` (``clear_forced``) is the only way past, with ``needlescope.outdir``'s meaning: it
deletes every file at a name the command writes (its ``OutputSpec``), recorded or not, changed or
not, and never a file at any other name; those stay, and the run does not record them as its own
(``Manifest(keep=...)``), so a later rerun without ``--force`` names them again.

Schema of the manifest file (JSON object): ``kind`` ("needlescope-output-manifest"), ``command``
(str), ``version`` (1), ``files`` (array of ``{"path": str, "bytes": int, "sha256": str}``).
"""

from __future__ import annotations

import json
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.outdir import OutputSpec, file_sha256

__all__ = ["MANIFEST_NAME", "Manifest", "clear", "clear_forced"]

MANIFEST_NAME = ".needlescope-demo"
KIND = "needlescope-output-manifest"


def _files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if (p.is_file() or p.is_symlink()) and p.name != MANIFEST_NAME)


class Manifest:
    """The files ``command`` wrote under ``out`` (which was empty or missing when it started, but
    for the files ``keep`` names: relative paths a forced run left in place)."""

    def __init__(self, out: Path, command: str, keep: frozenset[str] = frozenset()) -> None:
        self.out = out
        self.command = command
        self.keep = keep

    def record(self) -> None:
        """Record every file under ``out`` now but ``keep`` (all written by this run)."""
        files = [
            {"path": rel, "bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in _files(self.out)
            if not p.is_symlink() and (rel := p.relative_to(self.out).as_posix()) not in self.keep
        ]
        body = {"kind": KIND, "command": self.command, "version": 1, "files": files}
        tmp = self.out / (MANIFEST_NAME + ".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.out / MANIFEST_NAME)


def _read(out: Path) -> dict | None:
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict) or body.get("kind") != KIND or not isinstance(body.get("files"), list):
        return None
    return body


def check_clearable(out: Path) -> list[Path]:
    """The files ``clear`` would delete; BadInput (naming what is not the command's) when ``out``
    holds anything its manifest does not list with the same content."""
    if not out.exists():
        return []
    present = _files(out)
    if not present and not (out / MANIFEST_NAME).exists():
        return []  # an empty directory
    body = _read(out)
    if body is None:
        names = [p.relative_to(out).as_posix() for p in present][:3]
        held = ", ".join(names) + (" and more" if len(present) > 3 else "")
        raise BadInput(
            f"--out {str(out)!r} holds {held or 'files'} and no output manifest ({MANIFEST_NAME}) of an "
            "earlier run; the demo replaces only files it recorded writing: choose another directory, "
            "empty this one, or pass --force to replace the files at the demo's names"
        )
    recorded = {f.get("path"): f for f in body["files"] if isinstance(f, dict)}
    foreign = []
    for p in present:
        entry = recorded.get(p.relative_to(out).as_posix())
        if (
            entry is None
            or p.is_symlink()
            or p.stat().st_size != entry.get("bytes")
            or file_sha256(p) != entry.get("sha256")
        ):
            foreign.append(p.relative_to(out).as_posix())
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise BadInput(
            f"--out {str(out)!r} holds files the earlier run did not write, or changed since: {shown}; "
            "nothing was deleted: move them away, choose another directory, or pass --force to replace the "
            "files at the demo's names"
        )
    return present


def clear(out: Path) -> None:
    """Delete what ``check_clearable`` allows, the folders that held those files once empty, and
    the manifest; ``out`` itself stays."""
    _delete(out, check_clearable(out))


def clear_forced(out: Path, spec: OutputSpec) -> frozenset[str]:
    """``--force``: delete every file under ``out`` at a name ``spec`` writes, whoever wrote it,
    the folders that held them once empty, and the manifest; returns the relative paths of the
    files left (at other names: never touched)."""
    if not out.exists():
        return frozenset()
    present = {p.relative_to(out).as_posix(): p for p in _files(out)}
    _delete(out, [p for rel, p in present.items() if spec.covers(rel)])
    return frozenset(rel for rel in present if not spec.covers(rel))


def _delete(out: Path, files: list[Path]) -> None:
    """Delete ``files``, then the folders under ``out`` they leave empty, then the manifest."""
    for p in files:
        p.unlink()
    folders = {d for p in files for d in p.parents if out in d.parents}
    for d in sorted(folders, key=lambda d: len(d.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    (out / MANIFEST_NAME).unlink(missing_ok=True)
