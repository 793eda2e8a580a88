"""The demo deletes only files it recorded writing (issue 29, item 7): a directory whose names
merely look like demo output, or that holds one file more, is refused with nothing deleted; and
a server child dies with the process that started it, SIGKILL included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from needlescope.errors import BadInput
from needlescope.workflows.demo import check_out, prepare_out
from needlescope.workflows.manifest import MANIFEST_NAME, Manifest, check_clearable, clear


def _demo_like(out):
    (out / "reference").mkdir(parents=True)
    (out / "reference" / "results.sqlite").write_bytes(b"precious")
    (out / "DIAGNOSIS.md").write_text("my notes")
    (out / "fixes.json").write_text("{}")


def test_names_that_look_like_demo_output_are_not_deleted(tmp_path):
    out = tmp_path / "out"
    _demo_like(out)
    (out / MANIFEST_NAME).write_text("written by needlescope demo; the demo may replace this directory\n")
    with pytest.raises(BadInput, match="and no output manifest"):
        prepare_out(out)
    assert (out / "reference" / "results.sqlite").read_bytes() == b"precious"


def test_only_recorded_unchanged_files_are_deleted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    manifest = prepare_out(out)
    _demo_like(out)
    manifest.record()
    body = json.loads((out / MANIFEST_NAME).read_text())
    assert {f["path"] for f in body["files"]} == {"reference/results.sqlite", "DIAGNOSIS.md", "fixes.json"}

    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(BadInput, match="thesis.tex"):
        clear(out)
    assert (out / "DIAGNOSIS.md").exists() and (out / "thesis.tex").exists()
    (out / "thesis.tex").unlink()

    (out / "DIAGNOSIS.md").write_text("edited by hand")
    with pytest.raises(BadInput, match="DIAGNOSIS.md"):
        clear(out)
    assert (out / "DIAGNOSIS.md").read_text() == "edited by hand"
    (out / "DIAGNOSIS.md").write_text("my notes")

    (out / "reference" / "mine").mkdir()  # an empty folder of the user's: kept
    clear(out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["reference", "reference/mine"]
    assert check_clearable(out) == []


def test_force_replaces_the_demos_names_and_never_touches_another_file(tmp_path):
    """Issue 38: --force as needlescope.outdir means it: the files at the names the demo writes
    go, whoever wrote them; every other file stays byte for byte and is never recorded as the
    demo's, so a rerun without --force names it again."""
    from needlescope.dsa.checkpoint import shipped_dir

    out = tmp_path / "out"
    _demo_like(out)
    (out / "drafts").mkdir()
    (out / "drafts" / "a.txt").write_bytes(b"\x00draft\xff")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="no output manifest.*pass --force"):
        check_out(out, shipped_dir())
    check_out(out, shipped_dir(), force=True)
    with pytest.raises(BadInput, match="overlaps the checkpoint"):
        check_out(shipped_dir(), shipped_dir(), force=True)  # --force never reaches the checkpoint
    manifest = prepare_out(out, force=True)
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert left == [MANIFEST_NAME, "drafts/a.txt", "notes.txt"]
    assert (out / "drafts" / "a.txt").read_bytes() == b"\x00draft\xff" and (
        out / "notes.txt"
    ).read_text() == "mine"
    (out / "DIAGNOSIS.md").write_text("the demo's")
    manifest.record()
    assert [f["path"] for f in json.loads((out / MANIFEST_NAME).read_text())["files"]] == ["DIAGNOSIS.md"]
    with pytest.raises(BadInput, match="drafts/a.txt, notes.txt.*pass --force"):
        clear(out)
    assert (out / "DIAGNOSIS.md").read_text() == "the demo's"


def test_manifest_lists_nothing_outside_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside").write_text("x")
    (out / "link").symlink_to(tmp_path / "outside")
    Manifest(out, "demo").record()
    assert json.loads((out / MANIFEST_NAME).read_text())["files"] == []
    with pytest.raises(BadInput, match="link"):
        check_clearable(out)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that may never come in a container counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


PARENT = """
import sys, threading, time
from needlescope.testing.servers import scripted
started = []
if sys.argv[1] == "thread":  # started from a thread that ends at once, as pool threads do
    t = threading.Thread(target=lambda: started.append(scripted(window=100).start()))
    t.start()
    t.join()
    time.sleep(1.5)  # past the child's first parent checks: the thread's end must not stop it
else:
    started.append(scripted(window=100).start())
print(started[0].pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("start_from", ["main", "thread"])
def test_server_child_dies_with_a_sigkilled_parent(tmp_path, start_from):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, start_from], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child), "the server child died before its parent did"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        for _ in range(100):
            if not _alive(child):
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the server child outlived its SIGKILLed parent by 10 s")
    finally:
        parent.kill()
