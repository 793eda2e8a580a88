"""An outsider's bugs in the investigation: ledgers and env files that are not UTF-8, case records
a run would reuse from another ledger, and a patch without an undo whose change to the model's
config outlived its configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from needlescope.errors import BadInput
from needlescope.investigate.measure.state import RunState

LEDGER = """\
[target]
model = "organism"
threads = 2
reference = "k=fp32 topk=16"
candidate = "{candidate}"
{target_extra}
[symptom]
lengths = [256]
depths = [0, 50, 100]
trials = 1
max_new_tokens = 4

[[suspects]]
id = "{sid}"
tier = 1
hypothesis = "h"
{mapping}
checks = ["ablation"]
"""


def _ledger(
    d: Path, *, candidate="k=fp8_e4m3 topk=16", target_extra="", sid="k", mapping='setting = "k=fp8_e4m3"'
):
    path = d / "investigation.toml"
    path.write_text(LEDGER.format(candidate=candidate, target_extra=target_extra, sid=sid, mapping=mapping))
    return path


def test_a_ledger_that_is_not_utf8_is_one_line_and_exit_2(tmp_path, run_cli):
    path = tmp_path / "investigation.toml"
    path.write_bytes(b'[target]\nmodel = "\xff\xfe"\n')
    code, out, err = run_cli("investigate", "run", str(path), "--out", str(tmp_path / "out"))
    assert code == 2, (out, err)
    assert "Traceback" not in out + err and "UnicodeDecodeError" not in out + err
    assert f"{path}:2: not UTF-8 text" in " ".join((out + err).split()), (out, err)


def test_an_env_file_that_is_not_utf8_is_read_not_a_crash(tmp_path):
    from needlescope.investigate.ledger.differences import differences
    from needlescope.investigate.ledger.ledger import load_ledger
    from needlescope.investigate.measure.questions import QuestionContext, answer

    (tmp_path / "deployment.env").write_bytes(b"LANG=caf\xe9\nSGLANG_X=1\n")
    ledger = load_ledger(_ledger(tmp_path, target_extra='env_file = "deployment.env"'))
    # the deployment's variables are differences (the reference's environment is empty) ...
    names = {d.name for d in differences(ledger) if d.kind == "env"}
    assert names == {"LANG", "SGLANG_X"}, names
    # ... and an env question reads the file too
    q = ledger.suspects[0].questions  # none in this ledger: build one from a second ledger
    assert q == ()
    extra = '[[suspects.questions]]\ntype = "env"\nname = "SGLANG_X"\n'
    path = tmp_path / "investigation.toml"
    path.write_text(path.read_text() + extra)
    (q,) = load_ledger(path).suspects[0].questions
    ctx = QuestionContext(base=tmp_path, checkpoint=None, endpoint="", env_file=tmp_path / "deployment.env")
    a = answer(q, ctx)
    assert a.ok and a.value == "1", a


def test_a_different_ledger_is_refused_without_advice_that_reuses_its_records(tmp_path):
    out = tmp_path / "out"
    RunState(out, "ledger A", ["k"]).append_record("candidate", {"case_id": "c0", "correct": False})
    with pytest.raises(BadInput) as exc:
        RunState(out, "ledger B", ["k"])
    # The old advice, "delete state.json", made the next run read ledger A's records in measure/
    # as ledger B's (resumed by configuration name): a wrong candidate recall, silently.
    assert "delete" not in str(exc.value), exc.value
    assert "pass a new --out" in str(exc.value) and str(out / "measure") in str(exc.value), exc.value
    assert RunState(out, "ledger A", ["k"]).records("candidate") == [{"case_id": "c0", "correct": False}]


WINDOW_PATCH = """\
def apply(model):
    model.config.sliding_window = 4  # the deployment's attention window set too small; no undo
"""


def test_a_no_undo_patch_of_the_config_does_not_leak_into_later_configurations(tmp_path):
    pytest.importorskip("torch")
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.investigate.ledger.ledger import load_ledger
    from needlescope.investigate.ledger.plan import Config
    from needlescope.investigate.measure.session import Session
    from needlescope.progress import no_progress
    from needlescope.setting import PatchRef, Setting

    (tmp_path / "window.py").write_text(WINDOW_PATCH)
    (tmp_path / "noop.py").write_text("def apply(model):\n    pass\n")
    path = _ledger(
        tmp_path,
        candidate="k=fp32 topk=16",
        target_extra='extra_patches = ["window.py"]',
        sid="window",
        mapping='patch = "window.py"',
    )
    model, tok, _ = load_bundle("organism")
    window = model.config.sliding_window
    session = Session(load_ledger(path), tmp_path / "out", no_progress)
    session.load((model, tok))
    before = session.measure("reference", session.reference)
    cand = session.measure("candidate", session.candidate)
    assert [r["answer"] for r in cand] != [r["answer"] for r in before]  # the patch does something
    # the reference again, under another label (a no-op patch) so that it is measured, not copied
    again = session.measure(
        "again", Config(Setting.parse("k=fp32 topk=16"), (PatchRef.resolve(tmp_path / "noop.py"),))
    )
    assert model.config.sliding_window == window
    assert [r["answer"] for r in again] == [r["answer"] for r in before]


def test_an_edited_patch_file_is_measured_again_never_read_back_from_its_old_records(tmp_path):
    """A user who fixed a patch file and ran the same --out again got the old patch's records
    back as the new one's (records were reused by configuration name): refused now while
    state.json stands; with it moved aside, only what changed is measured again."""
    pytest.importorskip("torch")
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.investigate.ledger.ledger import load_ledger
    from needlescope.investigate.measure.session import Session
    from needlescope.progress import no_progress

    patch = tmp_path / "deploy.py"
    patch.write_text("def apply(model):\n    pass\n")
    path = _ledger(
        tmp_path,
        candidate="k=fp32 topk=16",
        target_extra='extra_patches = ["deploy.py"]',
        sid="deploy",
        mapping='patch = "deploy.py"',
    )
    loaded = load_bundle("organism")[:2]
    out = tmp_path / "out"

    def session() -> Session:
        s = Session(load_ledger(path), out, no_progress)
        s.load(loaded)
        return s

    first = session()
    ref = [r["answer"] for r in first.measure("reference", first.reference)]
    assert [r["answer"] for r in first.measure("candidate", first.candidate)] == ref  # a no-op
    stored = (out / "measure" / "reference.jsonl").read_text()

    patch.write_text(WINDOW_PATCH)  # the deployment's patch, edited
    with pytest.raises(BadInput, match="different patch files"):
        session()
    (out / "state.json").rename(tmp_path / "state.json.old")
    second = session()
    assert [r["answer"] for r in second.measure("reference", second.reference)] == ref
    assert (out / "measure" / "reference.jsonl").read_text() == stored  # reused, nothing measured
    cand = second.measure("candidate", second.candidate)
    assert [r["answer"] for r in cand] != ref  # measured under the edited patch
    aside = (out / "measure" / "candidate.jsonl.superseded").read_text().splitlines()
    assert len(aside) == len(ref) and len(
        (out / "measure" / "candidate.jsonl").read_text().splitlines()
    ) == len(ref)
