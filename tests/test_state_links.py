"""Issue 54, items 1, 8 and 13: no state, lock or output file is written through a symbolic link
planted in ``--out``, and two runs racing into one fresh folder end in one line.

Item 1: a link at a state or lock name (the store's lock, its partial file's lock, its journals,
the investigation's run lock, its ``state.json`` temporary and case records) is refused in one
line, exit 2, and left as it is; the file it points at is untouched. Item 8: ``--force`` replaces a
link at an output name, never writes through it. Item 13: a second ``create_store`` while the first
builds the file is refused in one line instead of deleting the first one's partial file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from needlescope.errors import BadInput

VICTIM = "the victim's own bytes\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    return victim


def _untouched(victim: Path, link: Path) -> None:
    assert victim.read_text() == VICTIM  # not truncated, no pid written through the link
    assert link.is_symlink()  # the link is the user's: never deleted


@pytest.mark.parametrize(
    "name",
    [
        "results.sqlite.lock",
        "results.sqlite.partial.lock",
        "results.sqlite-wal",
        "results.sqlite.partial-shm",
    ],
)
def test_a_link_at_a_store_state_name_is_refused_and_its_target_untouched(tmp_path, name):
    from needlescope.run.store import create_store

    victim = _victim(tmp_path)
    out = tmp_path / "o5"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(BadInput, match=f"{name} is a symbolic link"):
        create_store(out / "results.sqlite", {"fingerprint": {}}, [{"case_id": "a"}])
    _untouched(victim, out / name)
    assert sorted(os.listdir(out)) == [name]  # nothing made, nothing deleted


def test_a_store_at_a_link_is_not_resumed_through_it(tmp_path):
    from needlescope.run.store import ResultStore, create_store

    create_store(tmp_path / "elsewhere.sqlite", {"fingerprint": {}}, [{"case_id": "a"}]).close()
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.sqlite").symlink_to(tmp_path / "elsewhere.sqlite")
    before = (tmp_path / "elsewhere.sqlite").read_bytes()
    with pytest.raises(BadInput, match="results.sqlite is a symbolic link"):
        ResultStore(out / "results.sqlite")
    assert (tmp_path / "elsewhere.sqlite").read_bytes() == before
    assert not (out / "results.sqlite.lock").exists()  # the lock it took is let go and deleted


def test_probe_refuses_a_linked_lock_in_one_line_and_touches_nothing_outside_out(
    scripted_server, tmp_path, run_cli
):
    """The issue's reproduction: ``ln -s ../victim o5/results.sqlite.lock; needlescope probe ... --out o5``."""
    victim = _victim(tmp_path)
    out = tmp_path / "o5"
    out.mkdir()
    (out / "results.sqlite.lock").symlink_to("../victim")
    url = scripted_server(window=100_000)
    code, _, err = run_cli("probe", "--base-url", url, "--model", "scripted", "--lengths", "200",
                           "--depths", "50", "--trials", "1", "--out", str(out))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "results.sqlite.lock is a symbolic link" in err
    _untouched(victim, out / "results.sqlite.lock")


def test_the_investigations_lock_and_state_files_are_never_written_through_a_link(tmp_path):
    from needlescope.investigate.measure.state import LOCK_NAME, RunState, run_lock

    victim = _victim(tmp_path)
    out = tmp_path / "inv"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(BadInput, match=r"\.lock is a symbolic link"), run_lock(out):
        pass
    _untouched(victim, out / LOCK_NAME)

    (out / "state.json.tmp").symlink_to(victim)
    with pytest.raises(BadInput, match=r"state\.json\.tmp is a symbolic link"):
        RunState(out, "ledger", ["s1"])
    _untouched(victim, out / "state.json.tmp")
    (out / "state.json.tmp").unlink()

    state = RunState(out, "ledger", ["s1"])
    (out / "measure" / "cfg.jsonl").symlink_to(victim)
    with pytest.raises(BadInput, match=r"cfg\.jsonl is a symbolic link"):
        state.append_record("cfg", {"case": 1})
    _untouched(victim, out / "measure" / "cfg.jsonl")

    other = tmp_path / "inv2"
    other.mkdir()
    (other / "measure").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(BadInput, match="measure is a symbolic link"):
        RunState(other, "ledger", ["s1"])


def test_force_replaces_a_link_at_an_output_name_and_never_follows_it(tmp_path):
    from needlescope.outdir import OutputSpec, check_outputs, guarded_out

    victim = _victim(tmp_path)
    out = tmp_path / "out"
    (out / "plots").mkdir(parents=True)
    (out / "report.md").symlink_to(victim)
    (out / "plots" / "a.png").symlink_to(victim)
    (out / "dangling.md").symlink_to(tmp_path / "nowhere" / "made.md")
    (out / "state.db").symlink_to(victim)
    spec = OutputSpec("cmd", ("report.md", "plots/", "dangling.md", "state.db"), state=("state.db",))
    with pytest.raises(BadInput, match="was not written by needlescope"):
        check_outputs(out, spec)  # without --force: refused, as before
    with guarded_out(out, spec, force=True):
        for name in ("report.md", "plots/a.png", "dangling.md"):
            assert not (out / name).is_symlink()  # removed before the command writes
            (out / name).write_text("new\n")
    assert victim.read_text() == VICTIM and not (tmp_path / "nowhere").exists()
    assert (out / "report.md").read_text() == "new\n"
    assert (out / "state.db").is_symlink()  # a state name: left to the state's code, which refuses it
    manifest = json.loads((out / ".needlescope-out.json").read_text())
    assert set(manifest["files"]) == {"report.md", "plots/a.png", "dangling.md"}
    (out / f".needlescope-out.json.{os.getpid()}.tmp").symlink_to(victim)  # the manifest's temporary
    with pytest.raises(BadInput, match="tmp is a symbolic link"), guarded_out(out, spec):
        pass
    assert victim.read_text() == VICTIM


def test_a_second_store_started_while_the_first_builds_is_refused_in_one_line(tmp_path, monkeypatch):
    """Item 13, deterministically: the second ``create_store`` runs while the first is between
    writing its partial file and renaming it (where the race struck). Before the fix the second
    deleted the first's partial file and the first's rename raised FileNotFoundError."""
    from needlescope.run import store as store_mod

    path = tmp_path / "results.sqlite"
    second: list[str] = []
    add_cases = store_mod.ResultStore.add_cases

    def racing(self, cases):
        add_cases(self, cases)
        if not second:
            try:
                store_mod.create_store(path, {"fingerprint": {"run": 2}}, [{"case_id": "b"}]).close()
                second.append("made a store")
            except BadInput as exc:
                second.append(str(exc))

    monkeypatch.setattr(store_mod.ResultStore, "add_cases", racing)
    with store_mod.create_store(path, {"fingerprint": {"run": 1}}, [{"case_id": "a"}]) as first:
        assert [c["case_id"] for c in first.cases()] == ["a"]
    assert len(second) == 1 and second[0].startswith(f"another needlescope run (pid {os.getpid()})"), second
    with pytest.raises(BadInput, match="already holds a run"):  # and once the first has ended
        store_mod.create_store(path, {"fingerprint": {"run": 3}}, [{"case_id": "c"}])


@pytest.mark.parametrize("name", ["results.sqlite-wal", "results.sqlite"])
def test_a_store_killed_mid_run_then_linked_is_refused_by_name_on_resume(tmp_path, name):
    """The outside round of issue 54: a probe killed (kill -9) mid-run leaves its store and
    journals; a link then planted at one of them was refused on ``--resume`` as "not a usable
    needlescope results database: unable to open database file", naming neither the link nor
    what to do."""
    from needlescope.run.store import create_store, peek

    victim = _victim(tmp_path)
    out = tmp_path / "okill"
    out.mkdir()
    create_store(out / "results.sqlite", {"fingerprint": {}}, [{"case_id": "a"}]).close()
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(victim)
    with pytest.raises(BadInput, match=f"{name} is a symbolic link"):
        peek(out / "results.sqlite")
    _untouched(victim, out / name)
