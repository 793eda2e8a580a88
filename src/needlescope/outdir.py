"""Output folders: a command overwrites only what a needlescope command of its own kind wrote.

Every command that writes into an ``--out`` folder names what it writes there (``OutputSpec``:
top-level file names, and folders whose every file it writes) and what it updates in place and
checks itself (``state``: a resumable ``results.sqlite`` is opened only after its own
fingerprint check). Before it writes anything, ``check_outputs`` looks at each file present at
one of those names and refuses (``BadInput``, one line naming the file, exit 2) unless the
folder's manifest records that this same command wrote it and its content is unchanged since:

- a file no needlescope command recorded (the user's own ``report.md``) is never overwritten;
- a file another command wrote (a probe's ``report.md`` under ``compare --out``) is not either;
- a file the user edited after we wrote it is the user's now.

Files at other names (notes, a ledger the command only reads) are never touched and never
block a run. ``force=True`` (the commands' ``--force``) is the only way past; a symbolic link at
an output name is then replaced (removed, so the command writes a new file there), never followed:
it may point outside ``out``. A link at a state name is left to the state's own code, which
refuses it (``paths.open_nofollow``). After the command
ends, however it ends, ``record_outputs`` records what it wrote (``guarded_out`` does both); a
SIGKILL between writing an output and recording it leaves that file unrecorded, and the rerun
then names it and refuses (``--force`` takes over). State files are exempt from the record
check, so a killed resumable run resumes.

A command that starts afresh on every run (``workflows.serve_probe_explain``: two probes that
must not resume an earlier run's stores) deletes its earlier outputs first, once
``check_outputs`` allowed them: ``clear_outputs`` deletes every file at the command's names,
the folders they leave empty, and their records; files at other names stay.

Schema of ``out/MANIFEST_NAME`` (JSON object): ``kind`` ("needlescope-out-manifest"),
``version`` (1), ``files``: an object from the file's path relative to ``out`` (POSIX) to
``{"command": str, "bytes": int, "sha256": str}``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.paths import open_nofollow

__all__ = [
    "MANIFEST_NAME",
    "OutputSpec",
    "check_outputs",
    "clear_outputs",
    "file_sha256",
    "guarded_out",
    "record_outputs",
]

MANIFEST_NAME = ".needlescope-out.json"
KIND = "needlescope-out-manifest"


@dataclass(frozen=True)
class OutputSpec:
    """What ``command`` writes in its output folder.

    ``writes``: top-level names; a name ending in ``/`` is a folder every file of which the
    command may write. ``state``: ``fnmatch`` patterns over paths relative to the folder for
    files the command updates in place and checks itself (never compared with the record)."""

    command: str
    writes: tuple[str, ...]
    state: tuple[str, ...] = ()

    def covers(self, rel: str) -> bool:
        """Whether the command may write the file at relative path ``rel``."""
        top = rel.split("/", 1)[0]
        return any(rel == name or (name.endswith("/") and top == name[:-1]) for name in self.writes)

    def is_state(self, rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, pattern) for pattern in self.state)


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hex, read a MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(out: Path) -> dict[str, dict]:
    """The recorded files (empty when there is no manifest or it is not one of ours)."""
    try:
        body = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(body, dict) or body.get("kind") != KIND or not isinstance(body.get("files"), dict):
        return {}
    return {k: v for k, v in body["files"].items() if isinstance(v, dict)}


def _present(out: Path, spec: OutputSpec) -> list[tuple[str, Path]]:
    """(relative path, path) of each file under ``out`` at a name ``spec`` writes, sorted."""
    found = []
    for name in spec.writes:
        path = out / name.rstrip("/")
        if path.is_symlink() or path.is_file():
            found.append((name.rstrip("/"), path))
        elif path.is_dir():
            found += [
                (p.relative_to(out).as_posix(), p) for p in path.rglob("*") if p.is_symlink() or p.is_file()
            ]
    return sorted(found)


def _recorded_above(path: Path) -> tuple[Path, dict] | None:
    """(folder, entry) of the nearest enclosing folder whose manifest records ``path``: a
    command records what it writes in subfolders in its own folder's manifest (``compare``'s
    ``a/`` and ``b/``), so a file there was written by needlescope though ``path``'s own folder
    has no record of it."""
    path = path.absolute()
    for folder in path.parents[1:]:
        entry = _read_manifest(folder).get(path.relative_to(folder).as_posix())
        if entry is not None:
            return folder, entry
    return None


def _conflict(rel: str, path: Path, entry: dict | None, command: str) -> str | None:
    """Why the file at ``rel`` is not ``command``'s to overwrite, or None when it is."""
    if entry is None:
        above = _recorded_above(path)
        if above is not None:
            # Not "was not written by needlescope": that sent users hunting for who had
            # tampered with a compare's side folder.
            folder, entry = above
            return f"was written by needlescope {entry.get('command')} into {folder}, not {command} here"
        return "was not written by needlescope"
    if entry.get("command") != command:
        return f"was written by needlescope {entry.get('command')}, not {command}"
    if (
        path.is_symlink()
        or path.stat().st_size != entry.get("bytes")
        or file_sha256(path) != entry.get("sha256")
    ):
        return f"was changed after needlescope {command} wrote it"
    return None


def _check_folder(out: Path) -> None:
    """BadInput when ``out``, or the nearest of its parents that exists, is not a folder: the
    command would otherwise fail with a traceback when it first writes (``investigate init FILE``,
    the first step of ``make demo`` with a file named demo-out), or, for a long command, only at
    its end. ``--force`` does not make a file a folder, so this holds with it too."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == out and out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is a file, not a folder; choose another --out")
    if existing != out and existing.exists() and not existing.is_dir():
        raise BadInput(
            f"--out {out}: {existing} is a file, so the folder cannot be made; choose another --out"
        )


def check_outputs(out: Path, spec: OutputSpec, *, force: bool = False) -> None:
    """BadInput naming the first file under ``out`` that ``spec.command`` would overwrite but
    did not write (or that changed since), the file itself when ``out`` is one (``_check_folder``);
    only the latter when ``force``, which removes each symbolic link at an output name instead
    (replaced by what the command writes, never written through). Creates nothing."""
    out = Path(out)
    _check_folder(out)
    if not out.is_dir():
        return
    if force:
        for rel, path in _present(out, spec):
            if path.is_symlink() and not spec.is_state(rel):
                path.unlink()
        return
    recorded = _read_manifest(out)
    for rel, path in _present(out, spec):
        if spec.is_state(rel):
            continue
        why = _conflict(rel, path, recorded.get(rel), spec.command)
        if why is not None:
            raise BadInput(
                f"--out {out}: {rel} {why}; nothing was overwritten: move it away, choose another "
                "--out, or pass --force to overwrite it"
            )


def record_outputs(out: Path, spec: OutputSpec) -> None:
    """Record every file now present at a name ``spec`` writes as ``spec.command``'s."""
    out = Path(out)
    if not out.is_dir():
        return
    files = _read_manifest(out)
    for rel, path in _present(out, spec):
        if path.is_symlink():
            continue
        files[rel] = {"command": spec.command, "bytes": path.stat().st_size, "sha256": file_sha256(path)}
    _write_manifest(out, files)


def _write_manifest(out: Path, files: dict[str, dict]) -> None:
    """Replace ``out``'s manifest by one recording ``files`` (relative path -> entry)."""
    body = {"kind": KIND, "version": 1, "files": dict(sorted(files.items()))}
    tmp = out / f"{MANIFEST_NAME}.{os.getpid()}.tmp"
    try:
        # never through a link planted at the temporary's name (paths.open_nofollow)
        with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w", encoding="utf-8") as f:
            f.write(json.dumps(body, indent=1) + "\n")
        tmp.replace(out / MANIFEST_NAME)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def clear_outputs(out: Path, spec: OutputSpec) -> None:
    """Delete every file under ``out`` at a name ``spec`` writes (call ``check_outputs`` first:
    this deletes whoever wrote them), the folders under ``out`` they leave empty, and their
    entries in the manifest. A symbolic link is removed, never followed."""
    out = Path(out)
    if not out.is_dir():
        return
    present = _present(out, spec)
    for _, path in present:
        path.unlink()
    folders = {d for _, p in present for d in p.parents if out in d.parents}
    for d in sorted(folders, key=lambda d: len(d.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    recorded = _read_manifest(out)
    if any(rel in recorded for rel, _ in present):
        _write_manifest(out, {k: v for k, v in recorded.items() if k not in dict(present)})


@contextmanager
def guarded_out(out: Path, spec: OutputSpec, *, force: bool = False) -> Iterator[None]:
    """``check_outputs`` before the body, ``record_outputs`` after it, however it ends."""
    check_outputs(out, spec, force=force)
    try:
        yield
    except BaseException:
        with suppress(OSError):  # a full or read-only disk: the command's own error is the one to show
            record_outputs(out, spec)
        raise
    record_outputs(out, spec)
