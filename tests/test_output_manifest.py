"""serve-probe-explain deletes only files it recorded writing (issue 29, item 7), through the one
output-manifest system (``needlescope.outdir``): files at its names that merely look like its
output, or that changed since, are refused with nothing deleted; files at other names are never
touched; and a server child dies with the process that started it, SIGKILL included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from needlescope.errors import BadInput
from needlescope.outdir import MANIFEST_NAME, record_outputs
from needlescope.workflows.serve_probe_explain import OUTPUTS, check_out, prepare_out


def _looks_like_its_output(out):
    (out / "reference").mkdir(parents=True)
    (out / "reference" / "results.sqlite").write_bytes(b"precious")
    (out / "DIAGNOSIS.md").write_text("my notes")
    (out / "fixes.json").write_text("{}")


@pytest.fixture
def model():
    from needlescope.dsa.checkpoint import shipped_dir

    return shipped_dir()


def test_names_that_look_like_its_output_are_not_deleted(tmp_path, model):
    out = tmp_path / "out"
    _looks_like_its_output(out)
    with pytest.raises(BadInput, match="DIAGNOSIS.md was not written by needlescope"):
        check_out(out, model)
    assert (out / "reference" / "results.sqlite").read_bytes() == b"precious"


def test_only_recorded_unchanged_files_are_deleted_and_other_names_stay(tmp_path, model):
    out = tmp_path / "out"
    _looks_like_its_output(out)
    record_outputs(out, OUTPUTS)
    recorded = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert set(recorded) == {"reference/results.sqlite", "DIAGNOSIS.md", "fixes.json"}

    (out / "DIAGNOSIS.md").write_text("edited by hand")
    with pytest.raises(BadInput, match="DIAGNOSIS.md was changed after needlescope serve-probe-explain"):
        check_out(out, model)
    assert (out / "DIAGNOSIS.md").read_text() == "edited by hand"
    (out / "DIAGNOSIS.md").write_text("my notes")

    (out / "thesis.tex").write_text("years of work")  # another name: never touched, never blocks
    (out / "reference" / "mine").mkdir()  # an empty folder of the user's: kept
    check_out(out, model)
    prepare_out(out)
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == [MANIFEST_NAME, "reference", "reference/mine", "thesis.tex"]
    assert json.loads((out / MANIFEST_NAME).read_text())["files"] == {}
    assert (out / "thesis.tex").read_text() == "years of work"


def test_force_replaces_its_names_and_never_touches_another_file(tmp_path, model):
    """Issue 38: --force as needlescope.outdir means it: the files at the names the pipeline
    writes go, whoever wrote them; every other file stays byte for byte and is never recorded
    as the pipeline's."""
    out = tmp_path / "out"
    _looks_like_its_output(out)
    (out / "drafts").mkdir()
    (out / "drafts" / "a.txt").write_bytes(b"\x00draft\xff")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="was not written by needlescope.*pass --force"):
        check_out(out, model)
    check_out(out, model, force=True)
    with pytest.raises(BadInput, match="overlaps the checkpoint"):
        check_out(model, model, force=True)  # --force never reaches the checkpoint
    prepare_out(out)
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert left == ["drafts/a.txt", "notes.txt"]
    assert (out / "drafts" / "a.txt").read_bytes() == b"\x00draft\xff"
    (out / "DIAGNOSIS.md").write_text("the pipeline's")
    record_outputs(out, OUTPUTS)
    assert list(json.loads((out / MANIFEST_NAME).read_text())["files"]) == ["DIAGNOSIS.md"]
    check_out(out, model)  # its own file, unchanged: a rerun replaces it


def test_a_link_at_its_name_is_removed_never_followed(tmp_path, model):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside").write_text("x")
    (out / "DIAGNOSIS.md").symlink_to(tmp_path / "outside")
    record_outputs(out, OUTPUTS)
    assert json.loads((out / MANIFEST_NAME).read_text())["files"] == {}
    with pytest.raises(BadInput, match="DIAGNOSIS.md"):
        check_out(out, model)
    check_out(out, model, force=True)
    assert not (out / "DIAGNOSIS.md").exists() and (tmp_path / "outside").read_text() == "x"


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
