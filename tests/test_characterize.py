"""The characterization of an unexplained divergence: one test per class and rule, on evidence
records built the way the routes build them (``selection_evidence.layer_selection`` over sets)."""

from __future__ import annotations

import itertools
import random

import pytest

from needlescope.investigate.decide.characterize import (
    VOCABULARY,
    Context,
    Evidence,
    LayerSelection,
    LengthCell,
    Localized,
    characterize,
    family_of,
    jaccard_chance,
)
from needlescope.investigate.decide.selection_evidence import Row, layer_selection

CTX = Context(
    route="in-process", ratio=4, topk=16, candidate_flags=("--index-k", "fp8_e4m3"), lengths=(512, 1024)
)
LIVE = Context(route="live", ratio=4, topk=16, base_url="http://127.0.0.1:8001", lengths=(512,))
SELECTIVE = (LengthCell(512, 12, 6, 0, 128), LengthCell(1024, 12, 8, 0, 256))


def _rows(candidate, reference=None, visible=128, needle=(40, 41), n=4):
    ref = frozenset(reference if reference is not None else range(40, 56))
    return [Row(frozenset(candidate), ref, visible, frozenset(needle)) for _ in range(n)]


def _ev(*layers, cells=SELECTIVE, **kw):
    return Evidence(
        recall_lost=True, recall_reference=1.0, recall_candidate=0.4, cells=cells, layers=layers, **kw
    )


def _decode_twin(sel: LayerSelection) -> LayerSelection:
    return LayerSelection(**{**sel.__dict__, "path": "decode"})


def test_jaccard_chance_is_exact():
    v, k = 9, 3
    ref = set(range(k))
    brute = [len(ref & set(s)) / len(ref | set(s)) for s in itertools.combinations(range(v), k)]
    assert jaccard_chance(v, k, k) == pytest.approx(sum(brute) / len(brute), abs=1e-12)
    assert jaccard_chance(16, 16, 16) == 1.0  # dense: every entry selected


def test_no_recall_lost_is_nothing_to_explain():
    ch = characterize(Evidence(recall_lost=False, recall_reference=1.0, recall_candidate=1.0), CTX)
    assert ch["classes"] == ["none"] and ch["text"] == "nothing to explain: no recall lost"
    # and DIAGNOSIS renders it (a benign bug's live run crashed there: its evidence had no rule)
    from needlescope.investigate.report.characterization import characterization_blocks

    blocks = characterization_blocks({"characterization": ch})
    assert blocks[1] == ("p", "nothing to explain: no recall lost.")
    assert blocks[-1][0] == "table" and blocks[-1][2][0][0] == "`none`"
    assert "unexplained" not in ch["text"]


def test_ranking_uninformative_against_the_exact_null():
    rnd = random.Random(0)
    rows = [
        Row(frozenset(rnd.sample(range(128), 16)), frozenset(range(40, 56)), 128, frozenset({40}))
        for _ in range(8)
    ]
    sel = layer_selection(1, "prefill", rows)
    ch = characterize(_ev(sel, _decode_twin(sel)), CTX)
    assert ch["classes"][0] == "ranking_uninformative", ch
    e = ch["evidence"]["ranking_uninformative"]
    assert e["chance"] == pytest.approx(jaccard_chance(128, 16, 16)) and e["overlap"] < 0.2
    assert "scoring bug" in ch["text"] and "chance" in ch["text"]
    # the localizer's finding there (a RoPE-table mismatch it named) is the where's and the line's
    rope = "query/key RoPE-table mismatch: the indexer's queries are rotated with the 'main' table"
    module = "model.layers.1.self_attn.compressor.indexer.rotary_emb[call 2]"
    loc = (Localized("prefill", module, "DeepseekV4RotaryEmbedding", 1, rope),)
    named = characterize(_ev(sel, _decode_twin(sel), localized=loc), CTX)
    assert named["where"]["family"] == "indexer scorer" and named["where"]["finding"] == rope
    assert rope in named["text"]


def test_needle_excluded_when_the_rest_agrees():
    sel = layer_selection(1, "prefill", _rows(set(range(42, 56)) | {100, 101}))
    ch = characterize(_ev(sel, _decode_twin(sel)), CTX)
    assert ch["classes"][0] == "needle_excluded", ch
    assert ch["evidence"]["needle_excluded"]["needle_candidate"] == 0
    # a top-k that drops the best entries keeps a third of a 3-entry needle in the first CSA layer
    # (the live run of topk_drops_best.py); a later layer, fed the changed hidden states, departs
    # more and does not decide
    needle = (40, 41, 42)
    first = layer_selection(1, "prefill", _rows(set(range(42, 56)) | {99, 100}, needle=needle))
    later = layer_selection(3, "prefill", _rows(set(range(70, 86)), needle=needle))
    ch = characterize(_ev(first, later), CTX)
    assert ch["classes"][0] == "needle_excluded", ch
    assert ch["evidence"]["needle_excluded"]["layer"] == 1
    # keeping more than half of them is not "excluded"
    kept = layer_selection(1, "prefill", _rows(set(range(41, 56)) | {99}, needle=needle))
    assert "needle_excluded" not in characterize(_ev(kept), CTX)["classes"]


def test_misaddressed_by_a_constant_shift_and_by_a_page_permutation():
    shifted = layer_selection(1, "prefill", _rows(range(41, 57)))
    assert shifted.shift == 1 and shifted.shift_overlap == 1.0
    ref = set(range(0, 8)) | set(range(64, 72))
    swapped = layer_selection(
        1, "prefill", _rows(set(range(128, 136)) | set(range(192, 200)), ref, visible=256)
    )
    for sel in (shifted, swapped):
        ch = characterize(_ev(sel, _decode_twin(sel)), CTX)
        assert ch["classes"][0] == "misaddressed", ch
        assert "ranking_uninformative" not in ch["classes"][:1]


def test_a_shift_that_agrees_up_to_the_live_references_rounding_is_misaddressed():
    """Issue 37's GPU table, live route, key_cache_shift2 at 1K/2K: the shifted selection agreed with
    the reference at Jaccard 0.80 (prefill) and 0.85 (decode) against chance 0.105, because the live
    reference runs at the reference precision, not the server's; a 0.9 Jaccard bar read it as
    ranking_uninformative. The recorded layer-1 evidence (docs/investigate_runs/planted_37_device.jsonl)."""
    common = dict(
        layer=1, rows=6, chance=0.10540397871899411, needle_visible=60, shift=2, permutation_overlap=0.0
    )
    prefill = LayerSelection(
        path="prefill", overlap=0.1296, shift_overlap=0.8036, needle_reference=14, needle_candidate=18,
        overlap_without_needle=0.12, **common,
    )  # fmt: skip
    decode = LayerSelection(
        path="decode", overlap=0.1429, shift_overlap=0.8457, needle_reference=44, needle_candidate=27,
        overlap_without_needle=0.13, **common,
    )  # fmt: skip
    ch = characterize(_ev(prefill, decode), LIVE)
    assert ch["classes"][0] == "misaddressed", ch
    # a shift that lifts the overlap only to where an unrelated selection sits is not one
    weak = LayerSelection(**{**decode.__dict__, "shift_overlap": 0.5})
    assert (
        "misaddressed"
        not in characterize(_ev(LayerSelection(**{**prefill.__dict__, "shift_overlap": 0.5}), weak), LIVE)[
            "classes"
        ]
    )


def test_positional_bias_at_the_end():
    sel = layer_selection(1, "prefill", _rows(range(112, 128)))
    ch = characterize(_ev(sel, _decode_twin(sel)), CTX)
    assert ch["classes"][0] == "positional_bias", ch
    assert ch["evidence"]["positional_bias"]["share_candidate"] == 1.0
    # a recency term in the scores (recency_bias.py, live: 74% in the last quarter, the reference 30%)
    rows = _rows(set(range(117, 128)) | {40, 41, 50, 60, 70}, visible=128)
    ch = characterize(_ev(layer_selection(1, "prefill", rows)), CTX)
    assert (
        ch["classes"][0] == "positional_bias"
        and ch["evidence"]["positional_bias"]["share_candidate"] == 11 / 16
    )
    # a top-k of half the visible entries can put only half of itself in a quarter: all 32 entries
    # of the last quarter selected is the whole of what it can hold (recency_bias.py in-process)
    full = _rows(set(range(96, 128)) | set(range(0, 32)), reference=range(16, 80), visible=128)
    ch = characterize(_ev(layer_selection(1, "prefill", full)), CTX)
    assert ch["classes"][0] == "positional_bias", ch
    assert ch["evidence"]["positional_bias"]["share_candidate"] == 1.0


def test_decode_only_when_prefill_selections_are_equal():
    same = layer_selection(1, "prefill", _rows(range(40, 56)))
    rnd = random.Random(1)
    dec = layer_selection(1, "decode", _rows(rnd.sample(range(128), 16)))
    ch = characterize(_ev(same, dec), CTX)
    assert ch["classes"][0] == "decode_only", ch
    assert ch["where"]["path"] == "decode" and ch["where"]["first_departing_layer"] == 1
    # with no decode rows the same prefill evidence cannot say it, and says what would
    ch2 = characterize(_ev(same), CTX)
    assert "decode_only" not in ch2["classes"]


def test_outside_selection_from_a_dense_length():
    sel = layer_selection(1, "prefill", _rows(range(40, 56)))
    cells = (LengthCell(64, 8, 6, 0, 16), *SELECTIVE)
    ch = characterize(_ev(sel, _decode_twin(sel), cells=cells), LIVE)
    assert ch["classes"][0] == "outside_selection", ch
    assert ch["where"]["cause"] == "upstream or downstream of the selection"
    assert ch["evidence"]["outside_selection"]["p"] < 0.05


def test_outside_selection_from_equal_selections_and_different_answers():
    sel = layer_selection(1, "prefill", _rows(range(40, 56)))
    loc = (Localized("prefill", "model.layers.0.mlp.gate", "DeepseekV4HashRouter", 0),)
    ch = characterize(_ev(sel, _decode_twin(sel), answers_differ=True, localized=loc), CTX)
    assert ch["classes"][0] == "outside_selection", ch
    assert ch["where"]["family"] == "MoE router" and ch["where"]["layer"] == 0


def test_length_residue_concentrates_on_one_class():
    cells = (
        LengthCell(1024, 8, 8, 0, 256),
        LengthCell(1025, 8, 0, 0, 256),
        LengthCell(1026, 8, 0, 0, 256),
        LengthCell(1027, 8, 1, 0, 256),
    )
    rnd = random.Random(2)
    sel = layer_selection(1, "prefill", _rows(rnd.sample(range(128), 16)))
    ch = characterize(_ev(sel, _decode_twin(sel), cells=cells), CTX)
    assert ch["classes"][0] == "length_residue", ch
    assert ch["evidence"]["length_residue"]["residue"] == 0
    # the same losses spread over every class are not a residue
    spread = tuple(LengthCell(c.length, 8, 4, 0, 256) for c in cells)
    assert "length_residue" not in characterize(_ev(sel, cells=spread), CTX)["classes"]
    # a boundary bug whose teacher-forced pass (prompt + answer tokens) misses the residue while
    # the decode pass (the prompt alone) hits it looks decode-only too: the residue ranks first
    # (boundary_residue.py in-process)
    same = layer_selection(1, "prefill", _rows(range(40, 56)))
    ch = characterize(_ev(same, _decode_twin(sel), cells=cells), CTX)
    assert ch["classes"][:2] == ["length_residue", "decode_only"], ch


def test_graded_loses_only_at_longer_lengths():
    rows = _rows(set(range(40, 50)) | set(range(90, 96)))
    sel = layer_selection(1, "prefill", rows)
    cells = (LengthCell(512, 12, 0, 0, 128), LengthCell(1024, 12, 5, 0, 256))
    ch = characterize(_ev(sel, _decode_twin(sel), cells=cells), CTX)
    assert ch["classes"] == ["graded"], ch
    # lost at the shortest length too: not graded
    flat = (LengthCell(512, 12, 5, 0, 128), LengthCell(1024, 12, 5, 0, 256))
    assert "graded" not in characterize(_ev(sel, cells=flat), CTX)["classes"]


def test_graded_is_a_loss_that_grows_with_length_not_a_clean_shortest_length():
    # The same window bug in a 1K/2K table: it has started to lose at 1K (4 of 12), and loses
    # twice that at 2K. The old rule (the shortest length loses nothing) called this undecided.
    sel = layer_selection(1, "prefill", _rows(set(range(40, 50)) | set(range(90, 96))))
    grows = (LengthCell(1024, 12, 4, 0, 256), LengthCell(2048, 12, 8, 0, 512))
    ch = characterize(_ev(sel, _decode_twin(sel), cells=grows), CTX)
    assert ch["classes"] == ["graded"], ch
    e = ch["evidence"]["graded"]
    assert (e["shortest_rate"], e["longest_rate"]) == (4 / 12, 8 / 12)
    # more than half the longest's rate at the shortest length: flat enough not to be graded
    assert (
        "graded"
        not in characterize(
            _ev(sel, cells=(LengthCell(1024, 12, 5, 0, 256), LengthCell(2048, 12, 8, 0, 512))), CTX
        )["classes"]
    )
    # a loss that shrinks with length is not graded either
    shrinks = (LengthCell(1024, 12, 8, 0, 256), LengthCell(2048, 12, 4, 0, 512))
    assert "graded" not in characterize(_ev(sel, cells=shrinks), CTX)["classes"]
    # gains count against losses: 4 lost and 4 gained at the shortest length is no net loss
    netted = (LengthCell(1024, 12, 4, 4, 256), LengthCell(2048, 12, 2, 0, 512))
    assert characterize(_ev(sel, _decode_twin(sel), cells=netted), CTX)["classes"] == ["graded"]


def test_undecided_says_what_would_decide_and_the_next_command_runs_it():
    ch = characterize(Evidence(recall_lost=True, cells=(LengthCell(1024, 8, 3, 0, 256),)), LIVE)
    assert ch["classes"] == ["undecided"]
    assert any("dense lengths" in u for u in ch["undecided"])
    assert (
        ch["next"].startswith("needlescope probe --base-url http://127.0.0.1:8001")
        and "--lengths 32,64" in ch["next"]
    )
    assert "undecided" in ch["text"] and "unexplained" not in ch["text"]


def test_every_class_is_in_the_vocabulary_and_the_families():
    assert set(VOCABULARY) >= {
        "ranking_uninformative",
        "needle_excluded",
        "misaddressed",
        "positional_bias",
        "decode_only",
        "outside_selection",
        "length_residue",
        "graded",
        "none",
        "undecided",
    }
    assert (
        family_of("model.layers.1.self_attn.compressor.indexer.scorer", "DeepseekV4IndexerScorer")
        == "indexer scorer"
    )
    assert (
        family_of("model.layers.1.self_attn.compressor.indexer", "DeepseekV4Indexer")
        == "index-key cache/compressor"
    )
    assert family_of("model.layers.3.self_attn.o_b_proj", "Linear") == "attention"
    # the indexer's own rotary feeds its scores (a q/k RoPE-table mismatch is a scoring bug)
    rotary = "model.layers.1.self_attn.compressor.indexer.rotary_emb[call 2]"
    assert family_of(rotary, "DeepseekV4RotaryEmbedding") == "indexer scorer"
    assert family_of("model.layers.0.mlp.gate", "DeepseekV4HashRouter") == "MoE router"
    assert family_of("model.layers.2.post_attention_layernorm", "DeepseekV4RMSNorm") == "norm/other"


def test_the_characterization_reads_no_patch():
    import inspect

    from needlescope.investigate.decide import characterize as mod
    from needlescope.investigate.decide import next_step, selection_evidence

    for m in (mod, next_step, selection_evidence):
        src = inspect.getsource(m)
        assert "import torch" not in src and "open(" not in src and "Path(" not in src
        assert ".patch" not in src and "extra_patches" not in src


def test_every_next_command_runs_as_printed(tmp_path):
    """Each experiment's command parses with needlescope's own CLI, and every file it names is one
    the run wrote (absolute, present, readable as the option reads it): no placeholder."""
    import json

    from needlescope.investigate.decide.next_step import next_command as _command
    from next_command import check_next

    ids, prompt, patch = tmp_path / "input_ids.json", tmp_path / "prompt.json", tmp_path / "p1.py"
    ids.write_text(json.dumps({"input_ids": [1, 2, 3], "needle_token_span": [1, 2]}))
    prompt.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    patch.write_text("def apply(model):\n    pass\n")
    flags = ("--index-k", "fp8_e4m3", "--index-q", "fp32", "--score-dtype", "fp32")
    inproc = Context(
        route="in-process", ratio=4, topk=16, lengths=(512,), input_ids=str(ids), device="cuda",
        candidate_flags=(*flags, "--extra-patch", str(patch)), sweep_flags=(*flags, "--patch", str(patch)),
    )  # fmt: skip
    many_patches = Context(**{**inproc.__dict__, "sweep_flags": None})
    live = Context(**{**LIVE.__dict__, "prompt": str(prompt), "needle": "the key", "served_model": "m"})
    no_case = Context(**{**LIVE.__dict__, "served_model": "m"})
    for ctx in (inproc, many_patches, live, no_case):
        for experiment in ("dense", "residue", "selection", "paths", "localize"):
            command = _command(ctx, experiment)
            params = check_next(command)
            assert params.get("model") or params.get("sglang"), command
    assert check_next(_command(inproc, "residue"))["patch"] == str(patch)
    assert check_next(_command(live, "paths"))["prompt"] == prompt
