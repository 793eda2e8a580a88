"""Durable, resumable run state in one SQLite file.

Every finished request is committed at once (WAL journal), so a run
killed with SIGKILL loses at most the requests in flight; on resume each case is run until it
has exactly one ``ok`` row. Error rows are replaced when the case is retried. A run that sends
each case in several arms (engine-state) keeps one row per (factor, arm, case) in ``sends``.

One writer at a time: a store holds an exclusive ``flock`` on ``<file>.lock`` beside it for as
long as it is open (and deletes it when it closes), so a second run with the same ``--out`` is refused with one line instead of
mixing two grids into one file; ``create_store`` holds it from before the file is built, so two
runs started at once into one fresh folder end in that line too. No state file is written
through a symbolic link: the lock is opened with ``O_NOFOLLOW`` and a link at the store's name,
its ``-wal``/``-shm`` journals or the partial file is refused (one line), never followed or deleted. ``peek`` reads a store without writing anything, so ``--resume``
checks a file (is it a needlescope store, which run made it) before opening it for writing and
leaves a foreign ``results.sqlite`` untouched.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from needlescope.errors import BadInput
from needlescope.paths import open_nofollow, refuse_links, unlink_own

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value JSON);
CREATE TABLE IF NOT EXISTS cases(case_id TEXT PRIMARY KEY, idx INTEGER, data JSON);
CREATE TABLE IF NOT EXISTS results(
    case_id TEXT PRIMARY KEY,
    status TEXT CHECK(status IN ('ok','error')),
    correct INTEGER NULL,
    answer TEXT,
    reasoning TEXT,
    finish_reason TEXT,
    prompt_tokens INTEGER,
    cached_tokens INTEGER,
    latency_s REAL,
    attempts INTEGER,
    error_kind TEXT,
    error TEXT,
    base_url TEXT,
    finished_at REAL,
    replica TEXT,
    connection TEXT
);
CREATE TABLE IF NOT EXISTS graded(
    case_id TEXT PRIMARY KEY,
    status TEXT CHECK(status IN ('ok','error')),
    method TEXT,
    data JSON,
    error TEXT,
    finished_at REAL
);
CREATE TABLE IF NOT EXISTS sends(
    factor TEXT,
    arm TEXT,
    case_id TEXT,
    status TEXT CHECK(status IN ('ok','error')),
    data JSON,
    finished_at REAL,
    PRIMARY KEY(factor, arm, case_id)
);
"""

RESULT_FIELDS = (
    "status",
    "correct",
    "answer",
    "reasoning",
    "finish_reason",
    "prompt_tokens",
    "cached_tokens",
    "latency_s",
    "attempts",
    "error_kind",
    "error",
    "base_url",
    "finished_at",
    "replica",
    "connection",
)


_TABLES = ("meta", "cases", "results")


def peek(path: str | Path) -> dict:
    """``{"fingerprint", "run_notes", "cases", "results", "ok", "sends_ok"}`` (all but the first
    two: row counts; ``ok`` and ``sends_ok`` count answered requests) of the store at ``path``, read without writing
    anything (SQLite read-only); BadInput when it is not a needlescope results database."""
    path = Path(path)
    refuse_links(*_journals(path))  # SQLite would follow one (a store killed mid-run, a link planted)
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not set(_TABLES) <= names:
                raise BadInput(
                    f"{path} is not a needlescope results database (it has no {', '.join(sorted(set(_TABLES) - names))} "
                    "table); it was left as it is: use another --out"
                )
            meta = {
                k: json.loads(v)
                for k, v in db.execute(
                    "SELECT key, CAST(value AS TEXT) FROM meta WHERE key IN ('fingerprint', 'run_notes')"
                )
            }
            (n,) = db.execute("SELECT COUNT(*) FROM cases").fetchone()
            (sent,) = db.execute("SELECT COUNT(*) FROM results").fetchone()
            (ok,) = db.execute("SELECT COUNT(*) FROM results WHERE status = 'ok'").fetchone()
            sends = 0
            if "sends" in names:  # a store made before engine-state had none
                (sends,) = db.execute("SELECT COUNT(*) FROM sends WHERE status = 'ok'").fetchone()
        finally:
            db.close()
    except (sqlite3.DatabaseError, ValueError) as e:
        raise BadInput(
            f"{path} is not a usable needlescope results database: {e}; it was left as it is"
        ) from None
    return {
        "fingerprint": meta.get("fingerprint"),
        "run_notes": meta.get("run_notes"),
        "cases": n,
        "results": sent,
        "ok": ok,
        "sends_ok": sends,
    }


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _lock(path: Path) -> int:
    """An exclusive lock on ``<path>.lock`` (held until the descriptor closes); BadInput naming
    the holder when another process has it.

    The holder deletes the lock file as it lets go (``_unlock``), so a finished run leaves none.
    A process that opened the file just before it was deleted may then lock a file no path
    names any more; it sees that (the path's inode is not its own) and opens the new one."""
    lock_path = _lock_path(path)
    while True:
        fd = open_nofollow(lock_path, os.O_RDWR | os.O_CREAT)  # a link there: BadInput
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise BadInput(
                f"another needlescope run (pid {holder}) is writing {path.parent}; wait for it to end or use another --out"
            ) from None
        try:
            current = os.lstat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # locked a deleted file: its holder has just ended; lock the path's file
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _unlock(path: Path, fd: int) -> None:
    """Delete the lock file, then let go of it (deleted first, so no one locks it after us); only
    the file this descriptor holds is deleted, never a link or another file at its name."""
    try:
        unlink_own(_lock_path(path), fd)
    finally:
        os.close(fd)


def _journals(path: Path) -> tuple[Path, ...]:
    """The store and the files SQLite opens beside it (following links, so none may be one)."""
    return (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"))


def create_store(path: Path, meta: dict[str, Any], cases: list[dict]) -> ResultStore:
    """A new store at ``path`` holding ``meta`` (in order) and ``cases``, opened.

    Built beside it (``NAME.partial``) and renamed into place once complete: a kill while it is
    written (SIGKILL, between the fingerprint and the cases) leaves no store with an identity
    and no cases, which ``--resume`` refuses and a fresh run calls a run already there, only a
    partial file the next start deletes. Closing the partial store checkpoints its WAL into the
    file before the rename."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    lock_fd = _lock(path)  # held from here to the store's close: a second run is one line
    try:
        refuse_links(*_journals(path))
        if path.exists():
            # Another run made it since the caller looked (and has ended: it held the lock).
            raise BadInput(
                f"{path} already holds a run; pass --resume to continue it or choose another --out"
            )
        leftovers = (*_journals(partial), *partial.parent.glob(partial.name + "-*"))
        refuse_links(*leftovers, _lock_path(partial))
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        with ResultStore(partial) as store:
            for key, value in meta.items():
                store.put_meta(key, value)
            store.add_cases(cases)
        os.replace(partial, path)
    except BaseException:
        _unlock(path, lock_fd)
        raise
    return ResultStore(path, lock_fd=lock_fd)  # it lets go of the lock itself if it fails


class ResultStore:
    def __init__(self, path: str | Path, *, lock_fd: int | None = None) -> None:
        """Open (creating) the store at ``path`` under its lock; ``lock_fd``: the lock already held
        (``create_store`` takes it before it builds the file)."""
        self.path = Path(path)
        self._lock_fd = _lock(self.path) if lock_fd is None else lock_fd
        try:
            refuse_links(*_journals(self.path))
        except BadInput:
            _unlock(self.path, self._lock_fd)
            raise
        try:
            # isolation_level=None: autocommit; we open explicit transactions where several rows go together.
            self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL survives process death (SIGKILL) fully; only an OS crash could lose the last commits.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
            cols = {row[1] for row in self._db.execute("PRAGMA table_info(results)")}
            # A store written before replicas, then connections, were recorded.
            for col in ("replica", "connection"):
                if col not in cols:
                    self._db.execute(f"ALTER TABLE results ADD COLUMN {col} TEXT")
        except sqlite3.DatabaseError as e:
            _unlock(self.path, self._lock_fd)
            if isinstance(e, sqlite3.OperationalError) and ("disk is full" in str(e) or "disk I/O" in str(e)):
                # No room to write (a full disk, a quota): the folder's fault, not the store's.
                raise BadInput(f"cannot write {self.path}: {e}: free space or choose another --out") from e
            raise BadInput(f"{self.path} is not a usable needlescope results database: {e}") from e

    @property
    def journal_mode(self) -> str:
        return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    def put_meta(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str) -> Any:
        # The JSON column has NUMERIC affinity: a bare number comes back as an int or float.
        row = self._db.execute("SELECT CAST(value AS TEXT) FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def add_cases(self, cases: list[dict]) -> None:
        """Insert cases in the given order; cases already present (same case_id) are kept as they are."""
        (start,) = self._db.execute("SELECT COALESCE(MAX(idx) + 1, 0) FROM cases").fetchone()
        with self._tx():
            for i, case in enumerate(cases):
                self._db.execute(
                    "INSERT OR IGNORE INTO cases(case_id, idx, data) VALUES (?, ?, ?)",
                    (case["case_id"], start + i, json.dumps(case)),
                )

    def cases(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._db.execute("SELECT data FROM cases ORDER BY idx")]

    def pending_case_ids(self) -> list[str]:
        """Cases, in order, that have no ``ok`` result (never run, or errored and to be retried)."""
        rows = self._db.execute(
            "SELECT c.case_id FROM cases c LEFT JOIN results r ON r.case_id = c.case_id "
            "WHERE r.status IS NULL OR r.status != 'ok' ORDER BY c.idx"
        )
        return [cid for (cid,) in rows]

    def record(self, case_id: str, **fields: Any) -> None:
        """Write (or replace) the result of ``case_id`` and commit immediately."""
        unknown = set(fields) - set(RESULT_FIELDS)
        if unknown:
            raise ValueError(f"unknown result fields: {sorted(unknown)}")
        if fields.get("status") not in ("ok", "error"):
            raise ValueError(f"result status must be 'ok' or 'error'; got {fields.get('status')!r}")
        fields.setdefault("finished_at", time.time())
        if isinstance(fields.get("correct"), bool):
            fields["correct"] = int(fields["correct"])
        cols = ["case_id", *RESULT_FIELDS]
        values = [case_id, *(fields.get(f) for f in RESULT_FIELDS)]
        self._db.execute(
            f"INSERT OR REPLACE INTO results({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
            values,
        )

    def pending_graded_ids(self) -> list[str]:
        """Cases, in order, without an ``ok`` graded score (the teacher-forced gold answer)."""
        rows = self._db.execute(
            "SELECT c.case_id FROM cases c LEFT JOIN graded g ON g.case_id = c.case_id "
            "WHERE g.status IS NULL OR g.status != 'ok' ORDER BY c.idx"
        )
        return [cid for (cid,) in rows]

    def record_graded(
        self, case_id: str, *, method: str | None, data: dict | None = None, error: str | None = None
    ) -> None:
        """Write (or replace) the graded score of ``case_id``: ``data`` when scored, else ``error``."""
        if (data is None) == (error is None):
            raise ValueError("a graded row has either data or an error")
        self._db.execute(
            "INSERT OR REPLACE INTO graded(case_id, status, method, data, error, finished_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (case_id, "ok" if error is None else "error", method, json.dumps(data), error, time.time()),
        )

    def graded(self) -> dict[str, dict]:
        """Graded rows by case_id: ``{status, method, error, **data}``."""
        cur = self._db.execute("SELECT case_id, status, method, data, error FROM graded")
        out = {}
        for case_id, status, method, data, error in cur:
            out[case_id] = {"status": status, "method": method, "error": error, **(json.loads(data) or {})}
        return out

    def record_send(self, factor: str, arm: str, case_id: str, *, ok: bool, data: dict) -> None:
        """Write (or replace) one send of ``case_id`` in one arm of a multi-arm run (engine-state)."""
        self._db.execute(
            "INSERT OR REPLACE INTO sends(factor, arm, case_id, status, data, finished_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (factor, arm, case_id, "ok" if ok else "error", json.dumps(data), time.time()),
        )

    def sends(self, factor: str) -> dict[tuple[str, str], dict]:
        """The sends of ``factor`` by (arm, case_id): ``{status, **data}``."""
        cur = self._db.execute("SELECT arm, case_id, status, data FROM sends WHERE factor = ?", (factor,))
        return {(arm, cid): {"status": status, **json.loads(data)} for arm, cid, status, data in cur}

    def results(self) -> list[dict]:
        """All result rows, in case order."""
        cur = self._db.execute(
            "SELECT r.* FROM results r LEFT JOIN cases c ON c.case_id = r.case_id ORDER BY c.idx, r.case_id"
        )
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur]

    def close(self) -> None:
        self._db.close()
        if self._lock_fd is not None:
            _unlock(self.path, self._lock_fd)  # releases the writer's lock
            self._lock_fd = None

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
