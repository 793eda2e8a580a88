"""A patch without an undo during an investigation: its file executes once per process, each
configuration applies it once, and no model it changed is measured again as clean: each
application is undone from a pristine copy (``dsa.pristine``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

PATCH = """
from pathlib import Path

LOG = Path(__file__).with_suffix(".log")
with LOG.open("a") as f:
    f.write("body\\n")


def apply(model):
    with LOG.open("a") as f:
        f.write("apply\\n")
    model.lm_head.weight.data.mul_(1.5)  # an in-place change, and no undo
    return None
"""


def test_no_undo_patch_runs_once_and_leaves_the_model_as_loaded(tmp_path, caplog):
    import logging

    import torch

    from needlescope.dsa.emulate import patched_for_good
    from needlescope.investigate.run import run_investigation

    (tmp_path / "for_good.py").write_text(PATCH)
    (tmp_path / "investigation.toml").write_text(
        "\n".join(
            [
                "[target]",
                'model = "organism"',
                "threads = 2",
                'reference = "k=fp32 topk=16"',
                'candidate = "k=fp32 topk=16"',
                'extra_patches = ["for_good.py"]',
                "[symptom]",
                "lengths = [256]",
                "depths = [50]",
                "trials = 2",
                "max_new_tokens = 4",
                "[[suspects]]",
                'id = "for_good"',
                "tier = 1",
                'hypothesis = "changes the model for good"',
                'patch = "for_good.py"',
                'checks = ["ablation"]',
            ]
        )
    )
    from needlescope.dsa.checkpoint import load_bundle

    model, tok, _ = load_bundle("organism")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        run_investigation(tmp_path / "investigation.toml", out, loaded=(model, tok))
    log = (tmp_path / "for_good.log").read_text().split()
    # the pristine copy's cost is logged once for the run, not once per application
    costs = [r.getMessage() for r in caplog.records if "returned no undo" in r.getMessage()]
    assert len(costs) == 1 and "pristine copy of the model" in costs[0] and " MB, " in costs[0], costs
    # one module execution; one application per configuration that carries the patch: the
    # candidate (both cases in one batch), the divergence (added alone to the reference) and the
    # top-32 fix (the candidate at twice its index_topk); the removal equals the reference
    assert log == ["body", "apply", "apply", "apply"], log
    # the caller's model is as loaded: every application was undone from its pristine copy ...
    assert patched_for_good(model) is None
    fresh = load_bundle("organism")[0]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    v = json.loads((out / "verdicts.json").read_text())
    (s,) = v["suspects"]
    # ... yet every later measure ran; two cases cannot exclude any cost, and the verdict says so
    assert s["verdict"] == "inconclusive" and "too few cases to exclude a cost of 50 points" in s["reason"], s
    configs = json.loads((out / "investigation.json").read_text())["configs"]
    assert configs["remove-for_good"]["label"] == configs["reference"]["label"]
    # its sufficiency (added alone to the reference) equals the candidate: copied, never applied
    assert configs["alone-for_good"]["label"] == configs["candidate"]["label"]
    assert set(configs) == {"reference", "candidate", "remove-for_good", "alone-for_good", "topk-32"}
