"""Outsider: bugs nobody told the investigation about, written the way monkeypatches of a
DeepSeek-V4 model are (no undo, module state), characterized from measurements alone.

* a compressed-key cache slot reused across requests (``STALE_SLOT``): the failing case answers
  right when rerun alone, so its selections equal the reference's; that must not be read as
  "every selection equals the reference's while the answers differ" (outside_selection: a bug
  in attention, MoE or norms) for a bug inside the indexer's key cache;
* a top-k that keeps the first k entries by index, not by score, past a length (``FIRST_K``):
  a position-dependent selection, in CSA layer 1's prefill.
"""

from __future__ import annotations

import pytest

from needlescope.investigate.decide.characterize import Context, Evidence, LayerSelection, characterize

# A cache slot reused across requests: the indexer's first page (16 entries) keeps what the
# previous request wrote there, in module state (leaks between requests and batches).
STALE_SLOT = """
PAGE = 16
_SLOT = {}


def apply(model):
    for name, mod in model.named_modules():
        if type(mod).__name__ != "DeepseekV4IndexerScorer":
            continue
        inner = mod.forward

        def forward(q, compressed_kv, hidden_states, inner=inner, name=name):
            kv = compressed_kv
            n = min(PAGE, kv.shape[1])
            old = _SLOT.get(name)
            if old is not None and n > 0:
                kv = kv.clone()
                kv[:, : min(n, old.shape[0])] = old[:n].to(kv.dtype)
            if q.shape[1] > 1 and n > 0:  # a prefill writes its page for the next request
                _SLOT[name] = compressed_kv[0, :n].detach().clone()
            return inner(q, kv, hidden_states)

        mod.forward = forward
"""

# top-k by index past 96 visible entries (a "fast path" above a length threshold).
FIRST_K = """
import torch


def apply(model):
    for _, mod in model.named_modules():
        if type(mod).__name__ != "DeepseekV4IndexerScorer":
            continue
        inner = mod.forward

        def forward(q, compressed_kv, hidden_states, inner=inner):
            s = inner(q, compressed_kv, hidden_states)
            if s.shape[-1] <= 96:
                return s
            return -torch.arange(s.shape[-1], dtype=s.dtype).expand_as(s).clone()

        mod.forward = forward
"""


def _session(tmp_path, patch: str, lengths: str, depths: str):
    from needlescope.investigate.ledger.ledger import load_ledger
    from needlescope.investigate.measure.session import Session

    (tmp_path / "p1.py").write_text(patch)
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
                f"lengths = [{lengths}]",
                f"depths = [{depths}]",
                "trials = 1",
                "max_new_tokens = 4",
                "[[suspects]]",  # a decoy: not the planted bug
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
    return inv


def test_a_failure_that_does_not_reproduce_alone_is_not_called_outside_selection(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from characterized import characterized
    from needlescope.investigate.measure import characterize as measure

    monkeypatch.setattr(measure, "FAILING_CASES", 1)
    # depth 10 at 256 tokens puts the needle in the first page; batched after depth 50, its
    # decode steps read depth 50's page (the batch's first row wrote the slot)
    inv = _session(tmp_path, STALE_SLOT, "256", "50, 10")
    ref = inv.measure("reference", inv.reference)
    cand = inv.measure("candidate", inv.candidate)
    assert sum(r["correct"] for r in ref) > sum(r["correct"] for r in cand)  # the bug costs recall
    ch = characterized(inv, ref, cand)
    # before: ["outside_selection"] "every selection equals the reference's while the answers
    # differ ... upstream or downstream of the indexer's selection (attention, MoE, norms)"
    assert "outside_selection" not in ch["classes"], ch
    # the kind of bug named: the failure needs what ran before it (the batch's first row's slot)
    assert ch["classes"] == ["state_dependent"], ch
    assert ch["evidence"]["state_dependent"]["not_reproduced"] == 1 == ch["measured"]["rerun"]
    assert "rerun alone" in ch["text"] and "never reset" in ch["text"], ch["text"]


def test_topk_by_index_past_a_length_is_positional_in_layer_1_prefill(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from characterized import characterized
    from needlescope.investigate.measure import characterize as measure

    monkeypatch.setattr(measure, "FAILING_CASES", 1)
    inv = _session(tmp_path, FIRST_K, "512", "30, 70")
    ref = inv.measure("reference", inv.reference)
    cand = inv.measure("candidate", inv.candidate)
    assert sum(r["correct"] for r in ref) > sum(r["correct"] for r in cand)
    ch = characterized(inv, ref, cand)
    assert ch["classes"][0] == "positional_bias", ch
    assert "first quarter" in ch["evidence"]["positional_bias"]["rule"]
    assert ch["where"]["first_departing_layer"] == 1 and ch["where"]["path"] == "prefill", ch["where"]
    assert ch["measured"]["not_reproduced"] == 0


def _agreeing(layer: int, path: str) -> LayerSelection:
    return LayerSelection(layer=layer, path=path, rows=1, overlap=1.0, chance=0.15)


def test_selections_of_a_rerun_that_answered_right_decide_nothing():
    """The deciding function on recorded evidence: every selection the reference's, the only
    failing case's rerun answered right: undecided, saying so; the same selections from a rerun
    that failed again: outside_selection."""
    ctx = Context(route="in-process", ratio=4, topk=16)
    layers = tuple(_agreeing(n, p) for n in (1, 3) for p in ("prefill", "decode"))
    failed_again = characterize(Evidence(recall_lost=True, layers=layers, answers_differ=True), ctx)
    assert failed_again["classes"] == ["outside_selection"]
    right_alone = characterize(Evidence(recall_lost=True, layers=(), not_reproduced=1, rerun=1), ctx)
    assert right_alone["classes"] == ["state_dependent"]
    # one of two failing cases answers right alone: which kind is undecided, and it says why
    partly = characterize(Evidence(recall_lost=True, layers=(), not_reproduced=1, rerun=2), ctx)
    assert partly["classes"] == ["undecided"]
    assert partly["undecided"][0].startswith("1 failing case(s) answered otherwise when rerun alone")
    assert "rerun alone" in partly["text"]
