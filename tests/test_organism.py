"""Organism tokenizer, corpus and training recipe (tiny sizes on CPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from needlescope.cases.assemble import KINDS, CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle, require_deepseek_v4, resolve_model_dir  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.organism.config import DENSE_TOPK  # noqa: E402
from needlescope.organism.data import IGNORE, TRAIN_KINDS, DataSpec, encode_chat, make_example  # noqa: E402
from needlescope.organism.tokenizer import build_tokenizer  # noqa: E402
from needlescope.organism.train import TrainConfig, _caps, _digits, train  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _count(tok):
    return lambda m: len(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True)["input_ids"])


@pytest.mark.parametrize("kind", KINDS)
def test_probe_cases_have_no_unknown_tokens_and_round_trip(tok, kind):
    for case in build_cases(
        CaseSpec(kind=kind, lengths=(700,), depths=(0.0, 100.0), trials=2, seed=11), _count(tok)
    ):
        ids = tok.apply_chat_template(case.messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert tok.unk_token_id not in ids
        for m in case.messages:
            enc = tok(m["content"], add_special_tokens=False)["input_ids"]
            assert tok.decode(enc) == m["content"]


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok("is 4821357.", add_special_tokens=False)["input_ids"])
    assert pieces[-8:] == list("4821357") + ["."]


def test_encode_chat_matches_the_chat_template_and_masks_only_answers(tok):
    case = build_cases(
        CaseSpec(kind="multiturn", lengths=(900,), depths=(40.0,), trials=1, seed=2), _count(tok)
    )[0]
    msgs = [*case.messages, {"role": "assistant", "content": case.expected[0]}]
    ids, labels = encode_chat(tok, msgs, {len(msgs) - 1})
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    kept = [t for t, lbl in zip(ids, labels, strict=True) if lbl != IGNORE]
    assert tok.decode(kept) == case.expected[0] + tok.eos_token


def test_examples_are_deterministic_and_cover_every_kind(tok):
    spec = DataSpec(min_len=256, max_len=600)
    a = [make_example(tok, spec, s) for s in range(40)]
    b = [make_example(tok, spec, s) for s in range(40)]
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert {e.kind for e in a} == set(TRAIN_KINDS)
    for e in a:
        assert len(e.input_ids) == len(e.labels)
        assert any(lbl != IGNORE for lbl in e.labels)


def test_bad_recipe_values_are_rejected():
    with pytest.raises(ValueError):
        TrainConfig(kind_weights=(1.0, 2.0))
    with pytest.raises(ValueError):
        TrainConfig(steps_dense=-1)
    with pytest.raises(ValueError, match="dense_stop"):
        TrainConfig(steps_dense=3, dense_stop=4)


def test_recipe_runs_every_phase_and_writes_a_loadable_checkpoint(tmp_path):
    cfg = TrainConfig(
        steps_dense=2,
        steps_distil=1,
        steps_sparse=1,
        sparse_topk=8,
        tokens_per_batch=1024,
        min_len=128,
        max_len=384,
        workers=0,
        eval_every=2,
        eval_examples=2,
        eval_lengths=(200,),
        warmup=1,
        log_every=1,
        config_overrides={"hidden_size": 32, "moe_intermediate_size": 32},
    )
    rec = train(cfg, tmp_path / "ckpt", device="cpu")
    assert rec["steps"] == {"dense": 2, "distil": 1, "sparse": 1}
    saved = json.loads((tmp_path / "ckpt" / "training.json").read_text())
    assert saved["steps"] == rec["steps"] and saved["log"]
    model, tokenizer, path = load_bundle(tmp_path / "ckpt")
    require_deepseek_v4(path)
    assert model.config.index_topk == DENSE_TOPK and tokenizer.chat_template


def test_bundle_rejects_bad_directories(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        resolve_model_dir(tmp_path / "nope")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(BadInput, match="safetensors"):
        resolve_model_dir(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"")
    with pytest.raises(BadInput, match="DeepSeek-V4"):
        require_deepseek_v4(resolve_model_dir(tmp_path / "c"))
    assert save_random(tmp_path / "r", hidden_size=32).is_dir()


def test_hash_routing_table_is_seeded_distinct_and_saved(tmp_path):
    path = save_random(tmp_path / "h", seed=5, hidden_size=32, moe_intermediate_size=32)
    model, _, _ = load_bundle(path)
    tables = [b for n, b in model.named_buffers() if n.endswith("tid2eid")]
    assert len(tables) == sum(t == "hash_moe" for t in model.config.mlp_layer_types)
    for t in tables:
        assert t.shape[1] == model.config.num_experts_per_tok
        assert all(len(set(row)) == len(row) for row in t.tolist())  # distinct experts per token
        assert len(set(t[:, 0].tolist())) == model.config.n_routed_experts  # every expert is used
    again, _, _ = load_bundle(save_random(tmp_path / "h2", seed=5, hidden_size=32, moe_intermediate_size=32))
    other = [b for n, b in again.named_buffers() if n.endswith("tid2eid")]
    assert all(a.equal(b) for a, b in zip(tables, other, strict=True))


def test_window_curriculum_switches_to_the_checkpoint_window(tmp_path, tiny_train):
    cfg = TrainConfig(
        **tiny_train,
        steps_dense=4,
        steps_distil=1,
        wide_window=256,
        wide_window_frac=0.5,
        value_digits_start=1,
    )
    rec = train(cfg, tmp_path / "w", device="cpu")
    windows = [e["window"] for e in rec["log"] if e["phase"] == "dense"]
    assert windows == [256, 256, 32, 32]
    # dense_stop truncates the same schedule: the wide-window switch stays at step 2 of 4.
    cut = train(replace(cfg, dense_stop=3), tmp_path / "cut", device="cpu")
    assert cut["steps"]["dense"] == 3
    assert [e["window"] for e in cut["log"] if e["phase"] == "dense"] == [256, 256, 32]
    assert [e["window"] for e in rec["log"] if e["phase"] == "distil"] == [32]
    model, _, _ = load_bundle(tmp_path / "w")
    assert model.config.sliding_window == 32


def test_wide_window_phase_holds_short_examples_then_ramps_lengths_and_digits():
    cfg = TrainConfig(
        min_len=128,
        max_len=4096,
        wide_window=256,
        wide_window_frac=0.25,
        ramp_frac=0.5,
        value_digits=3,
        value_digits_start=1,
    )
    hold = cfg.wide_steps("dense", 100)
    assert hold == 25 and cfg.wide_steps("distil", 100) == 0
    caps = _caps(cfg, 100, True, hold)
    assert caps[:hold] == [256] * hold
    assert caps[hold] == 128 and caps[-1] == 4096
    assert all(a <= b for a, b in zip(caps[hold:], caps[hold + 1 :]))
    digits = _digits(cfg, 100, True, hold)
    assert set(digits[: hold + 1]) == {1} and digits[-1] == 3
    with pytest.raises(ValueError):
        TrainConfig(value_digits=2, value_digits_start=3)
