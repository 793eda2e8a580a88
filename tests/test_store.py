"""ResultStore: resume semantics, WAL, durability across SIGKILL; scheduler error recording."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from needlescope.errors import TransportFailure
from needlescope.run import ResultStore, run_cases
from needlescope.targets import ChatResult


def cases(n: int) -> list[dict]:
    return [
        {"case_id": f"c{i}", "messages": [{"role": "user", "content": str(i)}], "expected": [str(i)]}
        for i in range(n)
    ]


def test_wal_and_meta(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as s:
        assert s.journal_mode == "wal"
        s.put_meta("fingerprint", {"a": [1, 2]})
        assert s.get_meta("fingerprint") == {"a": [1, 2]} and s.get_meta("missing") is None
        for value in (7, 2.5, "12", None, [3]):
            s.put_meta("v", value)
            assert s.get_meta("v") == value


def test_resume_semantics(tmp_path):
    path = tmp_path / "r.sqlite"
    s = ResultStore(path)
    s.add_cases(cases(4))
    s.add_cases(list(reversed(cases(5))))  # duplicates ignored, order kept, new one appended
    assert [c["case_id"] for c in s.cases()] == ["c0", "c1", "c2", "c3", "c4"]
    s.record("c0", status="ok", correct=True, answer="0")
    s.record("c1", status="error", error_kind="transport", error="boom")
    s.record("c2", status="ok", correct=False, answer="x")
    with pytest.raises(ValueError):
        s.record("c3", status="weird")
    s.close()
    s = ResultStore(path)
    assert s.pending_case_ids() == ["c1", "c3", "c4"]
    s.record("c1", status="ok", correct=True, answer="1")  # the retry replaces the error row
    rows = s.results()
    assert [r["case_id"] for r in rows] == ["c0", "c1", "c2"]
    assert rows[1]["status"] == "ok" and rows[1]["error"] is None and rows[0]["correct"] == 1
    assert s.pending_case_ids() == ["c3", "c4"]
    s.close()


def test_records_survive_sigkill(tmp_path):
    path = tmp_path / "r.sqlite"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from needlescope.run.store import ResultStore
        s = ResultStore({str(path)!r})
        s.add_cases([{{"case_id": f"c{{i}}"}} for i in range(10)])
        for i in range(3):
            s.record(f"c{{i}}", status="ok", correct=True)
        print("WROTE", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "WROTE"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    with ResultStore(path) as s:
        assert [r["case_id"] for r in s.results()] == ["c0", "c1", "c2"]
        assert len(s.pending_case_ids()) == 7


class FakeTarget:
    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.order: list[str] = []

    async def chat(self, messages, *, max_tokens, extra_body=None):
        content = messages[0]["content"]
        self.order.append(content)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if content == "1":
            raise TransportFailure("down")
        return ChatResult(content, None, "stop", 3, 0, 0.01, 1, "http://t/v1")


def test_run_cases_records_errors_and_keeps_going(tmp_path):
    def score(answer: str, expected: list[str]) -> bool:
        if answer == "2":
            raise RuntimeError("scorer bug")
        return answer in expected

    seen: list[dict] = []
    target = FakeTarget()
    with ResultStore(tmp_path / "r.sqlite") as s:
        s.add_cases(cases(6))
        asyncio.run(
            run_cases(
                s.cases(),
                target,
                s,
                concurrency=2,
                max_tokens=4,
                extra_body=None,
                score=score,
                on_result=seen.append,
            )
        )
        rows = {r["case_id"]: r for r in s.results()}
        assert len(rows) == 6 and len(seen) == 6
        assert rows["c1"]["status"] == "error" and rows["c1"]["error_kind"] == "transport"
        assert rows["c1"]["correct"] is None
        assert rows["c2"]["error_kind"] == "internal" and "scorer bug" in rows["c2"]["error"]
        assert all(rows[c]["correct"] == 1 for c in ("c0", "c3", "c4", "c5"))
        assert s.pending_case_ids() == ["c1", "c2"]
    assert target.peak == 2 and target.order == [str(i) for i in range(6)]


# ---- one writer, read-only resume checks (issue 29, item 5) ---------------------------------------


def test_second_writer_is_refused_while_the_first_holds_the_store(tmp_path):
    import subprocess
    import sys

    from needlescope.errors import BadInput
    from needlescope.run.store import ResultStore

    path = tmp_path / "results.sqlite"
    with ResultStore(path):
        # Another process (flock is per open file, so a second process is the honest test).
        code = (
            "import sys; from needlescope.run.store import ResultStore\n"
            "from needlescope.errors import BadInput\n"
            f"try:\n    ResultStore({str(path)!r})\nexcept BadInput as e:\n    print(e); sys.exit(2)\n"
        )
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "another needlescope run" in res.stdout, res
        with pytest.raises(BadInput, match="another needlescope run"):
            ResultStore(path)
    ResultStore(path).close()  # released on close


def test_resume_leaves_a_foreign_sqlite_file_untouched(tmp_path):
    import hashlib
    import sqlite3

    from needlescope.errors import BadInput
    from needlescope.run.store import peek

    path = tmp_path / "results.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE photos(id INTEGER, name TEXT)")
    db.execute("INSERT INTO photos VALUES (1, 'cat')")
    db.commit()
    db.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(BadInput, match="not a needlescope results database"):
        peek(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]
