"""Layer-major streaming (``dsa.streaming``) equals the in-memory run, on the organism and on a
4-layer Flash-shaped checkpoint (fp8 projections, the release's packed fp4 experts) at reduced
widths: the rank dump record for record, the live emulation's two paths (teacher-forced chunks;
prompt in chunks then decode token by token) capture for capture, and each layer is read once per
pass. In float64, as the chunked tests (tests/test_dsa_passes.py say why)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.blockfp4 import dequantize_block_fp4, quantize_block_fp4  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits  # noqa: E402
from needlescope.dsa.emulate import IndexerCapture, emulate  # noqa: E402
from needlescope.dsa.loading import placement_of  # noqa: E402
from needlescope.dsa.passes import decode, prefill  # noqa: E402
from needlescope.dsa.prompt import render_prompt  # noqa: E402
from needlescope.dsa.quant import quantize_fp4_e2m1  # noqa: E402
from needlescope.dsa.rankdump import rank_dump  # noqa: E402
from needlescope.dsa.streaming import is_streamed, streamer_of  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.flash import TEST_WIDTHS, write_flash_checkpoint  # noqa: E402

SETTING = Setting(index_topk=16)  # below the entries a 600-token prompt has: a real selection


def _f64(model):
    model = model.double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


def _count_reads(model) -> list[str]:
    """Every tensor name the streamed model's reader reads from now on."""
    reader, names = streamer_of(model).reader, []
    get = reader.get

    def counted(name):
        names.append(name)
        return get(name)

    reader.get = counted
    return names


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash") / "fp4"
    write_flash_checkpoint(path, overrides=TEST_WIDTHS, experts="fp4", shard_bytes=1 << 20)
    return path


@pytest.fixture(scope="module")
def organism_pair():
    memory, tok, path = load_bundle("organism")
    streamed, _, _ = load_bundle("organism", stream_layers=True)
    return _f64(memory), _f64(streamed), tok, path


def test_fp4_packing_is_the_e2m1_grid_with_one_scale_per_32():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 128)
    packed, scale = quantize_block_fp4(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (16, 64)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (16, 4)
    assert torch.equal(dequantize_block_fp4(packed, scale, dtype=torch.float32), quantize_fp4_e2m1(w))
    # the even column sits in the low nibble: codes 1 (0.5) then 0xB (-1.5), scale 1
    one = dequantize_block_fp4(torch.tensor([[0xB1] + [0] * 15], dtype=torch.uint8), torch.ones(1, 1))
    assert one[0, :2].tolist() == [0.5, -1.5] and not one[0, 2:].any()
    with pytest.raises(ValueError, match="needs a scale of shape"):
        dequantize_block_fp4(packed, scale[:, :2])


def test_streamed_organism_rank_dump_equals_in_memory_record_for_record(organism_pair):
    memory, streamed, tok, path = organism_pair

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    case = build_cases(
        CaseSpec("single", (600,), (30.0,), 1, 5, value_digits=trained_value_digits(path)), count
    )[0]
    out = []
    for model in (memory, streamed):
        capture = IndexerCapture(keep_scores=True)
        with torch.no_grad(), emulate(model, SETTING, capture=capture):
            dump = rank_dump(
                model, tok, case.messages, needle=case.needle, setting=SETTING, max_new_tokens=2,
                capture=capture, chunk=256, expected=case.expected,
            )  # fmt: skip
        out.append((dump, capture))
    (one, cap_one), (two, cap_two) = out
    assert (
        two == one
        and one["generated_tokens"]
        and any(p["best_rank"] > 1 for layer in one["layers"] for p in layer["positions"])
    )
    for layer in cap_one.layers():
        assert torch.equal(cap_two.rows(layer, 16)[1], cap_one.rows(layer, 16)[1])
        rows_two, rows_one = cap_two.score_rows(layer)[1], cap_one.score_rows(layer)[1]
        assert len(rows_two) == len(rows_one) and all(torch.equal(x, y) for x, y in zip(rows_two, rows_one))
    # one pass for the prompt and one per fed answer token, every layer read once in each
    stream = streamer_of(streamed)
    n_passes = len(one["generated_tokens"])  # prompt + (generated - 1) decode steps
    assert [[r["layer"] for r in p] for p in stream.passes[-n_passes:]] == [list(range(5))] * n_passes


def _live_paths(model, ids: list[int], n_prompt: int, chunk: int) -> list[torch.Tensor]:
    """The live emulation's two paths (``investigate.live.emulate_rows``) on ``model``: logits and
    the captured top-k rows of each CSA layer, teacher-forced in chunks, then prompt in chunks and
    answer decoded token by token."""
    out = []
    for path in ("prefill", "decode"):
        capture = IndexerCapture()
        with torch.no_grad(), emulate(model, SETTING, capture=capture) as layers:
            if path == "decode":
                run = prefill(model, torch.tensor([ids[:n_prompt]]), chunk=chunk, keep_cache=True)
                logits = decode(model, torch.tensor([ids[n_prompt:]]), run.cache).logits
            else:
                logits = prefill(
                    model, torch.tensor([ids]), chunk=chunk, logits_at=range(n_prompt, len(ids))
                ).logits
        out += [logits] + [capture.rows(layer, SETTING.index_topk)[1] for layer in layers]
    return out


def test_streamed_organism_live_emulation_paths_equal_in_memory(organism_pair):
    memory, streamed, _, _ = organism_pair
    ids = torch.randint(3, 3000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    reads = _count_reads(streamed)
    a, b = (_live_paths(m, ids, 296, 128) for m in (memory, streamed))
    assert len(a) == len(b) > 2 and all(torch.equal(x, y) for x, y in zip(a, b))
    # 2 prompt passes (3 chunks each) + 4 decode passes; each layer's tensors are read once per pass
    layer_reads = [n for n in reads if n.startswith("model.layers.0.")]
    per_pass = len({n for n in layer_reads})
    assert per_pass > 0 and len(layer_reads) == per_pass * 6


def test_streamed_flash_shaped_fp4_checkpoint_equals_in_memory(flash_dir):
    memory, tok, _ = load_bundle(flash_dir)
    streamed, _, _ = load_bundle(flash_dir, stream_layers=True)
    assert placement_of(memory) is not None and is_streamed(streamed) and not is_streamed(memory)
    expert = memory.model.layers[1].mlp.experts.gate_up_proj
    assert expert.dtype == torch.bfloat16 and bool(expert.abs().sum() > 0)
    memory, streamed = _f64(memory), _f64(streamed)
    ids = torch.randint(3, 3000, (133,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = (_live_paths(m, ids, 130, 64) for m in (memory, streamed))  # past an HCA window of 128
    assert len(a) == len(b) == 6 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert bool(torch.isfinite(a[0]).all())


def test_streamed_flash_shaped_rank_dump_and_greedy_answer_equal_in_memory(flash_dir):
    """The rank dump (its greedy answer included) on the 4-layer Flash-shaped checkpoint."""
    memory, tok, _ = load_bundle(flash_dir)
    streamed = load_bundle(flash_dir, stream_layers=True)[0]
    words = " ".join(f"w{i}" for i in range(60))
    messages = [{"role": "user", "content": f"{words} The secret code is 4815927. {words} What is the code?"}]
    dumps = []
    for model in (_f64(memory), _f64(streamed)):
        with torch.no_grad():
            dumps.append(rank_dump(model, tok, messages, needle="The secret code is 4815927.",
                                   setting=SETTING, max_new_tokens=3, chunk=64))  # fmt: skip
    one, two = dumps
    assert two == one and len(one["generated_tokens"]) == 3 and one["prompt_tokens"] > 128
    assert [layer["layer"] for layer in one["layers"]] == [1, 3]
    assert [[r["layer"] for r in p] for p in streamer_of(streamed).passes] == [list(range(4))] * 3


def test_streamed_organism_localizer_equals_in_memory_record_for_record(tmp_path):
    from needlescope.dsa.diff import localize

    ids = torch.randint(3, 3000, (1, 40), generator=torch.Generator().manual_seed(6))
    fault = Setting(patch=_mlp_fault(tmp_path, 4))  # the last layer: few calls carry the fault
    memory = localize(load_bundle("organism")[0], load_bundle("organism")[0], ids, setting=fault, chunk=24)
    pair = [load_bundle("organism", stream_layers=True)[0] for _ in range(2)]
    streamed = localize(*pair, ids, setting=fault, chunk=24)
    assert memory["first_divergent_module"] == "model.layers.4.mlp"
    assert streamed == memory  # every module call of both chunks, every verdict
    assert [len(p) for p in streamer_of(pair[0]).passes] == [5] and not streamer_of(pair[1]).passes


def test_device_auto_streams_when_the_weights_do_not_fit_and_refuses_below_one_layer(flash_dir):
    from needlescope.dsa.placement import unit_bytes

    sizes = dict(unit_bytes(load_bundle(flash_dir)[0]))
    resident = sum(n for u, n in sizes.items() if not u.startswith("model.layers."))
    largest = max(n for u, n in sizes.items() if u.startswith("model.layers."))
    budget = resident + largest + 1024
    assert budget < sum(sizes.values())
    model, _, _ = load_bundle(flash_dir, device="auto", max_memory=str(budget), stream_if_needed=True)
    assert is_streamed(model) and streamer_of(model).device == "cpu"
    with pytest.raises(BadInput, match=r"streaming layer by layer needs .* larger --max-memory"):
        load_bundle(flash_dir, device="auto", max_memory=str(resident + largest - 1), stream_if_needed=True)
    with pytest.raises(BadInput, match="fits nowhere"):  # a caller that cannot run streamed: refused
        load_bundle(flash_dir, device="auto", max_memory=str(budget))
    with pytest.raises(BadInput, match="fits nowhere"):  # an explicit device list is placed or refused
        load_bundle(flash_dir, device="cpu", max_memory=str(budget))
    with pytest.raises(BadInput, match="--stream-layers runs on one device"):
        load_bundle(flash_dir, device="cpu,cpu", stream_layers=True)


# ---------------------------------------------------------------- the localizer in chunks


def _mlp_fault(tmp_path, layer: int):
    path = tmp_path / f"mlp{layer}.py"
    path.write_text(
        "def apply(model):\n"
        f"    handle = model.model.layers[{layer}].mlp.register_forward_hook(lambda m, a, o: o * 1.5)\n"
        "    return handle.remove\n"
    )
    return path


def test_chunked_localizer_names_the_planted_module_and_streamed_equals_in_memory(flash_dir, tmp_path):
    from needlescope.dsa.diff import localize, validate_diff

    ids = torch.randint(3, 3000, (1, 120), generator=torch.Generator().manual_seed(4))
    fault = Setting(patch=_mlp_fault(tmp_path, 3))
    one_pass = localize(load_bundle(flash_dir)[0], load_bundle(flash_dir)[0], ids, setting=fault)
    memory = localize(load_bundle(flash_dir)[0], load_bundle(flash_dir)[0], ids, setting=fault, chunk=48)
    pair = [load_bundle(flash_dir, stream_layers=True)[0] for _ in range(2)]
    reads = _count_reads(pair[0])
    streamed = localize(*pair, ids, setting=fault, chunk=48)
    validate_diff(memory)
    assert one_pass["first_divergent_module"] == memory["first_divergent_module"] == "model.layers.3.mlp"
    assert streamed == memory  # record for record: every module call of every chunk, every verdict
    keys = [m["module"] for m in memory["modules"] if m["exceeds"]]
    assert keys == ["model.layers.3.mlp", "model.layers.3.mlp[call 2]", "model.layers.3.mlp[call 3]"]
    assert all(
        m["rel_err"] == 0.0
        for m in memory["modules"]
        if not m["module"].startswith(("model.layers.3", "lm_head", "model.norm", "model.hc_head"))
    )
    # the streamed reference read each tensor of a layer once and lent it to the candidate
    layer2 = [n for n in reads if n.startswith("layers.2.")]
    assert layer2 and len(layer2) == len(set(layer2))
    assert not streamer_of(pair[1]).passes  # the candidate never read a layer


def test_chunked_localizer_replays_on_the_cache_before_each_chunk(tmp_path):
    """With no fault every replayed call (attention, compressors, indexers reading the cache of
    earlier chunks) reproduces the candidate exactly; a replay on the cache as it stood after the
    chunk would see its own keys twice and diverge."""
    from needlescope.dsa.diff import localize
    from needlescope.testing.checkpoints import save_random

    tiny = save_random(tmp_path / "tiny", seed=1, hidden_size=64, index_topk=4)
    ids = torch.randint(3, 3000, (1, 90), generator=torch.Generator().manual_seed(5))
    noop = tmp_path / "noop.py"
    noop.write_text("def apply(model):\n    return lambda: None\n")
    result = localize(load_bundle(tiny)[0], load_bundle(tiny)[0], ids, setting=Setting(patch=noop), chunk=32)
    assert result["first_divergent_module"] is None
    attn = [m for m in result["modules"] if m["module"].startswith("model.layers.1.self_attn[call")]
    assert attn and all(m["own_err"] == 0.0 for m in attn)


def _needle_prompt(tmp_path):
    words = " ".join(f"w{i}" for i in range(30))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(f"{words} The secret code is 4815927. {words} What is the secret code?")
    return prompt


def test_cli_rank_dump_streams_under_device_auto_when_the_budget_is_short(flash_dir, tmp_path, run_cli):
    import json

    out = tmp_path / "out"
    code, _, err = run_cli(
        "indexer", "rank-dump", "--model", str(flash_dir), "--prompt", str(_needle_prompt(tmp_path)),
        "--needle", "The secret code is 4815927.", "--max-new-tokens", "2", "--chunk", "40",
        "--device", "auto", "--max-memory", "4MiB", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    dump = json.loads((out / "rankdump.json").read_text())  # placed, 4 MiB would have been refused
    assert dump["prompt_tokens"] > 60 and len(dump["generated_tokens"]) == 2
    assert [layer["layer"] for layer in dump["layers"]] == [1, 3]


def test_cli_diff_streams_in_chunks_and_refuses_two_devices(flash_dir, tmp_path, run_cli):
    import json

    prompt = _needle_prompt(tmp_path)
    out = tmp_path / "out"
    args = ["indexer", "diff", "--model", str(flash_dir), "--prompt", str(prompt), "--needle",
            "The secret code is 4815927.", "--patch", str(_mlp_fault(tmp_path, 2))]  # fmt: skip
    code, stdout, err = run_cli(*args, "--chunk", "48", "--stream-layers", "--out", str(out))
    assert code == 1, err  # the planted fault is named: a finding
    assert json.loads((out / "diff.json").read_text())["first_divergent_module"] == "model.layers.2.mlp"
    assert "model.layers.2.mlp" in stdout
    code, _, err = run_cli(*args, "--stream-layers", "--device", "cpu,cpu", "--out", str(tmp_path / "o2"))
    assert code == 2 and "--stream-layers runs on one device" in err


# ---------------------------------------------------------------- the numerics audit


AUDIT_CHECKS = ["routed_scale", "hc_mix_bf16", "decode_splitk_bf16", "indexer_scores_bf16", "index_keys_fp8"]


def test_streamed_audit_equals_in_memory_and_reads_each_layer_once_per_pass():
    """Every check in chunks of 100 tokens: the op-level metrics are computed while each layer is
    on the device (its weights are gone after the pass), the decode-split check keeps each
    attention module's calls apart (layer-major runs them module by module, not chunk by chunk),
    and compounding runs reference and candidate in one layer-major pass. In float32: both runs
    call each layer on the same chunks, so even float32 gives the same bits."""
    from needlescope.audit.run import audit_model

    memory, tok, path = load_bundle("organism")
    streamed = load_bundle("organism", stream_layers=True)[0]
    one = audit_model(memory, tok, path, AUDIT_CHECKS, SETTING, 256, chunk=100)
    reads = _count_reads(streamed)
    two = audit_model(streamed, tok, path, AUDIT_CHECKS, SETTING, 256, chunk=100)
    assert two == one  # record for record: every metric, verdict and reason
    top1 = [m["value"] for r in one for m in r["metrics"] if m["metric"] == "compounded top-1 agreement"]
    assert len(top1) == 2 and all(0.9 < v <= 1.0 for v in top1)
    # one pass per capturing check (5), one per compounding (2): reference and candidate together
    passes = streamer_of(streamed).passes
    assert [[r["layer"] for r in p] for p in passes] == [list(range(5))] * 7
    layer_reads = [n for n in reads if n.startswith("model.layers.0.")]
    assert layer_reads and len(layer_reads) == len(set(layer_reads)) * 7


def test_cli_audit_streams_under_device_auto_and_takes_stream_layers(flash_dir, tmp_path, run_cli):
    import json

    args = ["audit", "--model", str(flash_dir), "--checks", "hc_mix_bf16", "--candidate", "topk=16",
            "--length", "120", "--prefill-chunk", "48"]  # fmt: skip
    outs = [tmp_path / "memory.json", tmp_path / "auto.json"]
    for out, extra in zip(outs, ([], ["--device", "auto", "--max-memory", "4MiB"])):
        code, _, err = run_cli(*args, *extra, "--out", str(out))
        flagged = json.loads(out.read_text())[0]["flagged"]  # a random checkpoint: may be flagged
        assert code == (1 if flagged else 0) and ("flagged: hc_mix_bf16" in err) == flagged, err
    memory, auto = (json.loads(out.read_text()) for out in outs)
    assert auto == memory and memory[0]["check"] == "hc_mix_bf16"  # 4 MiB would have been refused placed
    code, _, err = run_cli(*args, "--stream-layers", "--device", "cpu,cpu")
    assert code == 2 and "--stream-layers runs on one device" in err
