"""Resumable state of one investigation run directory.

``DIR/state.json`` (rewritten atomically: temp file, fsync, rename) caches measurements, never a
decision (``decide`` decides anew on every run, so a resumed run after a rule change decides by
the new rule). Its keys, each read and written only through ``RunState``'s accessors:

- ``ledger_sha256``: the run's fingerprint (the ledger's text and its patch files' bytes);
- ``suspects``: ID -> {"status": STATUS, "reason": str}, STATUS one of ``STATUSES`` (how far the
  measurement got: never a verdict);
- ``evidence``: ID -> [evidence record] (``decide.verdicts.evidence``);
- ``done``: STEP -> true, or the step's measured value (``measured:ID``, ``measured:localization``,
  ``measured:characterization``, ``questions``);
- ``configs``: name -> ``Config.to_json()`` of every configuration measured (``configs``);
- ``absent``: ID -> what a cheap question answered that means it is not deployed (``absent``);
- ``server_info``: the live server's ``/get_server_info`` (``server_info``), its identity on resume.
 ``DIR/measure/NAME.jsonl`` holds one measured case record a
line (``needlescope.investigate.measure.records``), appended and fsynced as each case finishes, so a
crash or Ctrl-C loses at most the case in flight and a resumed run measures only what is
missing. A torn last line (a kill mid-write) is dropped on reading and the file rewritten.
Resuming with a different ledger is refused. No state file is written through a symbolic link
at its name (``paths.open_nofollow``): a link there, or at ``measure/``, is refused in one line. Each record carries its ``basis``
(``measure.basis``): records another configuration, case or checkpoint would have measured are
moved to ``measure/NAME.jsonl.superseded`` by ``Session.measure``, never reused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.paths import atomic_write_json, open_nofollow, refuse_links

__all__ = ["STATUSES", "RunState", "run_lock", "LOCK_NAME"]

LOCK_NAME = ".lock"
"""The run directory's lock file: one ``investigate run`` at a time writes a directory."""

STATUSES = ("pending", "running", "measured")
"""How far a suspect's measurement got (a verdict is ``decide``'s, never kept here)."""


class RunState:
    """The state of ``out`` for the ledger whose text is ``ledger_text``."""

    def __init__(self, out: Path, ledger_text: str, suspect_ids: list[str]):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        refuse_links(self.out / "measure")  # its records would be written wherever it points
        (self.out / "measure").mkdir(exist_ok=True)
        self.path = self.out / "state.json"
        self._records: dict[str, list[dict]] = {}  # measure/NAME.jsonl, read once (``records``)
        digest = hashlib.sha256(ledger_text.encode()).hexdigest()
        if self.path.exists():
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
            if self.data.get("ledger_sha256") != digest:
                # Not "delete state.json": a fresh state reads the case records left in measure/
                # as this ledger's (measure/NAME.jsonl is resumed by configuration name).
                raise BadInput(
                    f"{self.out} holds a run of a different ledger or different patch files; pass "
                    f"a new --out, or move {self.path} aside to run here again (the records in "
                    f"{self.out / 'measure'} are then reused only for the configurations and cases "
                    "that did not change)"
                )
        else:
            self.data = {
                "ledger_sha256": digest,
                "suspects": {i: {"status": "pending", "reason": ""} for i in suspect_ids},
                "evidence": {i: [] for i in suspect_ids},
                "done": {},
            }
            self.save()

    @property
    def ledger_sha256(self) -> str:
        """The fingerprint of the ledger (and its patch files) this directory's run measured."""
        return self.data["ledger_sha256"]

    def configs(self) -> dict[str, dict]:
        """name -> ``Config.to_json()`` of every configuration measured in this directory."""
        return dict(self.data.get("configs", {}))

    def note_config(self, name: str, config: dict) -> None:
        """Keep ``config`` (``Config.to_json()``) under ``name`` (saved only when it changed)."""
        if self.data.setdefault("configs", {}).get(name) != config:
            self.data["configs"][name] = config
            self.save()

    def absent(self, sid: str) -> str | None:
        """What a cheap question answered that means ``sid`` is not deployed (None: nothing)."""
        return self.data.get("absent", {}).get(sid)

    def mark_absent(self, sid: str, why: str) -> None:
        """Keep ``why`` (a cheap question's answer) as the reason ``sid`` is not deployed."""
        self.data.setdefault("absent", {})[sid] = why

    @property
    def server_info(self) -> dict:
        """The live server's ``/get_server_info`` this run recorded first ({} when none)."""
        return self.data.get("server_info") or {}

    def set_server_info(self, info: dict) -> None:
        """Record the live server's ``/get_server_info`` once (the first answer stays)."""
        if "server_info" not in self.data:
            self.data["server_info"] = info
            self.save()

    def relativize(self, prefixes: dict[str, str]) -> None:
        """Rewrite this machine's absolute paths in the state (``paths.relativize``) and save."""
        from needlescope.paths import relativize

        self.data = relativize(self.data, prefixes)
        self.save()

    def ensure_suspects(self, ids: list[str]) -> None:
        """Add suspects found after the ledger (the automatic ones) as ``pending``."""
        new = [i for i in ids if i not in self.data["suspects"]]
        for i in new:
            self.data["suspects"][i] = {"status": "pending", "reason": ""}
            self.data["evidence"].setdefault(i, [])
        if new:
            self.save()

    def save(self) -> None:
        """Write ``state.json`` atomically."""
        atomic_write_json(self.path, self.data)

    def set_status(self, sid: str, status: str, reason: str = "") -> None:
        """Set how far ``sid``'s measurement got (``STATUSES``)."""
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self.data["suspects"][sid] = {"status": status, "reason": reason}
        self.save()

    def status(self, sid: str) -> str:
        """How far ``sid``'s measurement got (``STATUSES``)."""
        return self.data["suspects"][sid]["status"]

    def add_evidence(self, sid: str, records: list[dict]) -> None:
        """Append evidence records of ``sid`` (saved)."""
        self.data["evidence"][sid].extend(records)
        self.save()

    def keep_evidence(self, sid: str, keep) -> None:
        """Drop ``sid``'s evidence records for which ``keep(record)`` is false."""
        self.data["evidence"][sid] = [e for e in self.data["evidence"][sid] if keep(e)]
        self.save()

    def evidence(self, sid: str) -> list[dict]:
        """``sid``'s evidence records, in the order they were measured."""
        return self.data["evidence"][sid]

    def is_done(self, step: str) -> bool:
        """Whether ``step`` finished (its value is kept under ``done``)."""
        return bool(self.data["done"].get(step))

    def mark_done(self, step: str, value=True) -> None:
        """Mark ``step`` finished, keeping ``value`` (a measurement, never a decision)."""
        self.data["done"][step] = value
        self.save()

    def step_value(self, step: str):
        """The value ``mark_done`` kept for ``step`` (None: not finished)."""
        return self.data["done"].get(step)

    # -- measured cases -------------------------------------------------------------------
    def _mpath(self, name: str) -> Path:
        return self.out / "measure" / f"{name}.jsonl"

    def records(self, name: str) -> list[dict]:
        """The measured case records of configuration ``name`` (a torn last line is dropped): the
        file is read once a run, then kept in memory and appended through (``append_record``,
        ``supersede``)."""
        if name not in self._records:
            self._records[name] = self._read(name)
        return list(self._records[name])

    def _read(self, name: str) -> list[dict]:
        path = self._mpath(name)
        if not path.exists():
            return []
        out, torn = [], False
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                torn = True
        if torn:
            with _text(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in out)
        return out

    def supersede(self, name: str, keep: list[dict], moved: list[dict]) -> None:
        """Move ``moved`` out of ``measure/NAME.jsonl`` into ``measure/NAME.jsonl.superseded``
        (kept, never read as measured), leaving ``keep``. Appended there first, then the file
        replaced at once: a kill between the two leaves a record in both, never in neither."""
        path = self._mpath(name)
        with _text(path.with_name(path.name + ".superseded"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in moved)
            f.flush()
            os.fsync(f.fileno())
        tmp = path.with_name(path.name + ".tmp")
        with _text(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._records[name] = list(keep)

    def append_record(self, name: str, record: dict) -> None:
        """Append ``record`` to ``measure/NAME.jsonl`` (fsynced) and to the records in memory."""
        records = self._records.setdefault(name, None)
        if records is None:
            self._records[name] = records = self._read(name)
        with _text(self._mpath(name), "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        records.append(json.loads(json.dumps(record)))  # as a reader of the file would see it


def _text(path: Path, mode: str):
    """``open(path, mode)`` for ``mode`` "w" or "a", never through a link at ``path``."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if mode == "w" else os.O_APPEND)
    return os.fdopen(open_nofollow(path, flags), mode, encoding="utf-8")


@contextmanager
def run_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock for the block (created with ``out`` when missing). BadInput, one line,
    when ``out`` cannot be created or written (a read-only file system, a file in the way) or
    another run holds the lock; the lock goes with the process, however it ends."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = open_nofollow(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)  # a link there: BadInput
    except OSError as exc:
        raise BadInput(
            f"--out {str(out)!r} cannot be written ({exc.strerror}); pass a writable directory"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(
                f"another 'investigate run' is writing {str(out)!r} (it holds {LOCK_NAME}); "
                "wait for it to finish or pass another --out"
            ) from None
        yield
    finally:
        os.close(fd)
