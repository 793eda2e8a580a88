"""The in-process route's characterization on the organism: a planted decode-path bug that
returns no undo, unnamed by the ledger, characterized from measurements alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

PLANTED = Path(__file__).parent / "planted_bugs"


def test_a_decode_only_bug_is_characterized_decode_only(tmp_path, monkeypatch):
    from characterized import characterized
    from needlescope.investigate.ledger.ledger import load_ledger
    from needlescope.investigate.measure import characterize as measure

    monkeypatch.setattr(measure, "FAILING_CASES", 1)  # one failing case's selections decide it (cheap)
    from needlescope.investigate.measure.session import Session

    shutil.copy(PLANTED / "decode_sign_flip.py", tmp_path / "p1.py")  # the name says nothing
    (tmp_path / "investigation.toml").write_text(
        "\n".join(
            [
                "[target]",
                'model = "organism"',
                "threads = 2",
                'reference = "k=fp32 topk=16"',
                'candidate = "k=fp32 topk=16"',
                'extra_patches = ["p1.py"]',
                "[symptom]",
                "lengths = [256]",
                "depths = [50]",
                "trials = 1",
                "max_new_tokens = 6",
                "[[suspects]]",
                'id = "keys"',
                "tier = 1",
                'hypothesis = "fp8 keys"',
                'setting = "k=fp8_e4m3"',
                'checks = ["ablation"]',
            ]
        )
    )
    inv = Session(load_ledger(tmp_path / "investigation.toml"), tmp_path / "out", lambda *a: None)
    inv.load()
    ref = inv.measure("reference", inv.reference)
    cand = inv.measure("candidate", inv.candidate)
    assert sum(r["correct"] for r in ref) > sum(r["correct"] for r in cand)  # the bug costs recall

    ch = characterized(inv, ref, cand)
    assert ch["classes"][0] == "decode_only", ch
    e = ch["evidence"]["decode_only"]
    assert e["prefill_overlap"] == 1.0 and e["decode_overlap"] < e["chance"] + 0.2, e
    assert ch["where"]["path"] == "decode" and ch["where"]["cause"] == "in the selection"
    # the dense length (64 tokens at top-16) is too short for the needle: left out, said so
    assert ch["next"].startswith("needlescope indexer diff --model organism")
    from next_command import check_next

    params = check_next(ch["next"])  # runnable as printed: the failing case's ids written by the run
    assert str(params["input_ids"]).startswith(str((tmp_path / "out").resolve()))
    assert [str(p) for p in params["extra_patch"]] == [str((tmp_path / "p1.py").resolve())]
    lengths = {c["length"] for c in ch["measured"]["cells"]}
    assert {257, 258, 259} <= lengths  # the residue lengths around the failing one
    # nothing read the patch: the same records with no loss say "nothing to explain"
    assert characterized(inv, ref, ref)["classes"] == ["none"]
