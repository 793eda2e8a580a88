"""``compare-dump`` streamed: a 5-layer Flash-shaped checkpoint (fp8 projections, the release's packed
fp4 experts) at test widths is the engine and the reference. The two-rank dump is written streamed
(each layer read once, its files written while it is on the device), with a planted fault in
layer 4 (its MLP output x 1.5); the streamed comparison equals the in-memory one in every field
(the same layer-major computation), agrees with a one-pass comparison on every verdict (where no
top-k tie can break differently), names the planted layer and tensor, and finds every tensor within budget in the clean dump. Float64,
as the chunked tests.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.compare_dump import compare_dump  # noqa: E402
from needlescope.dsa.compare_dump_md import validate_compare_dump  # noqa: E402
from needlescope.dsa.dump_mapping import load_mapping  # noqa: E402
from needlescope.dsa.engine_dump import load_value, scan_dump  # noqa: E402
from needlescope.dsa.streaming import is_streamed, streamer_of  # noqa: E402
from needlescope.testing.flash import TEST_WIDTHS, write_flash_checkpoint  # noqa: E402
from needlescope.testing.sglang_dump import write_sglang_dump  # noqa: E402

LAYERS, FAULT_LAYER, CHUNK = 5, 4, 48  # layer 4 is a CSA layer
PASSES = [64, 52, 2, 2]  # a chunked prefill (not aligned to CHUNK), then two decode steps
TOKENS = sum(PASSES)


def _f64(model):
    model = model.double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(in-memory model, streamed model, ids, clean dump dir, faulty dump dir), the dumps written streamed."""
    root = tmp_path_factory.mktemp("flash_dump")
    ckpt = root / "ckpt"
    write_flash_checkpoint(ckpt, layers=LAYERS, overrides=TEST_WIDTHS, experts="fp4", shard_bytes=1 << 20)
    memory = _f64(load_bundle(ckpt)[0])
    streamed = _f64(load_bundle(ckpt, stream_layers=True)[0])
    ids = torch.randint(3, 3000, (TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    mapping = load_mapping()
    kw = dict(mapping=mapping, passes=PASSES, index_topk=8, chunk=CHUNK)
    clean = write_sglang_dump(streamed, ids, root / "clean", **kw)
    mlp = streamed.model.layers[FAULT_LAYER].mlp
    handle = mlp.register_forward_hook(lambda m, a, o: o * 1.5)
    try:
        passes_before = len(streamer_of(streamed).passes)
        faulty = write_sglang_dump(streamed, ids, root / "faulty", **kw)
        writer_passes = streamer_of(streamed).passes[passes_before:]
    finally:
        handle.remove()
    assert [[r["layer"] for r in p] for p in writer_passes] == [list(range(LAYERS))]
    return memory, streamed, ids, clean, faulty, ckpt


def test_streamed_dump_equals_the_in_memory_dump_file_for_file(setup, tmp_path):
    memory, _, ids, clean, _, _ = setup
    again = write_sglang_dump(
        memory, ids, tmp_path, mapping=load_mapping(), passes=PASSES, index_topk=8, chunk=CHUNK
    )
    files = {f.path.name: f for f in scan_dump(clean)}
    assert sorted(files) == sorted(f.path.name for f in scan_dump(again))
    assert any(f.layer == FAULT_LAYER for f in files.values()) and {f.rank for f in files.values()} == {0, 1}
    for name in files:
        a, b = load_value(clean / name)[0], load_value(again / name)[0]
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_streamed_compare_equals_in_memory_and_names_the_planted_layer(setup):
    memory, streamed, _, _, faulty, _ = setup
    mapping = load_mapping()
    before = len(streamer_of(streamed).passes)
    got = compare_dump(streamed, faulty, mapping, chunk=CHUNK)
    # the reference read each layer once
    assert [[r["layer"] for r in p] for p in streamer_of(streamed).passes[before:]] == [list(range(LAYERS))]
    assert got == compare_dump(memory, faulty, mapping, chunk=CHUNK)
    validate_compare_dump(got)
    want = f"non_intrusive__model.layers.{FAULT_LAYER}.mlp.output"
    assert got["first_beyond"] == {"engine_name": want, "reference": f"model.layers.{FAULT_LAYER}.mlp",
                                   "layer": FAULT_LAYER}  # fmt: skip
    assert all(
        t["verdict"] == "within budget"
        for t in got["tensors"]
        if t["layer"] is not None and t["layer"] < FAULT_LAYER
    )
    assert not got["unknown_names"] and not got["missing_reference"] and len(got["indexer"]) >= 2


def test_chunked_compare_agrees_with_one_pass(setup, tmp_path):
    """The layer-major reference joins each module's chunk calls by position (a chunk's top-k and
    scores padded to the widest): with the indexer selecting every visible entry (k 64 > 30
    entries, so no tie at a cut-off can break differently, docs/scale.md), chunks of 48 and one
    pass give every tensor the same rows within float64 reduction order and the same verdict."""
    memory, _, ids, _, _, _ = setup
    handle = memory.model.layers[FAULT_LAYER].mlp.register_forward_hook(lambda m, a, o: o * 1.5)
    try:
        dump = write_sglang_dump(memory, ids, tmp_path, mapping=load_mapping(), passes=PASSES, index_topk=64)
    finally:
        handle.remove()
    one, got = (compare_dump(memory, dump, load_mapping(), chunk=c) for c in (None, CHUNK))
    assert [t["engine_name"] for t in one["tensors"]] == [t["engine_name"] for t in got["tensors"]]
    assert [t["verdict"] for t in one["tensors"]] == [t["verdict"] for t in got["tensors"]]
    for a, b in zip(one["tensors"], got["tensors"]):
        assert b["rel_err"] == pytest.approx(a["rel_err"], rel=1e-9, abs=1e-12), a["engine_name"]
    assert one["first_beyond"] == got["first_beyond"] and one["first_beyond"]["layer"] == FAULT_LAYER
    assert (
        [r["topk_overlap"] for r in one["indexer"]]
        == [r["topk_overlap"] for r in got["indexer"]]
        == [1.0, 1.0]
    )


def test_streamed_compare_of_the_clean_dump_finds_every_tensor_within_budget(setup):
    _, streamed, _, clean, _, _ = setup
    got = compare_dump(streamed, clean, load_mapping(), chunk=CHUNK)
    assert got["first_beyond"] is None and got["tensors"]
    assert all(t["verdict"] == "within budget" for t in got["tensors"])
    assert {t["shard"] for t in got["tensors"]} >= {"replicated", "sum", "concat:-1"}
    assert all(r["topk_overlap"] == 1.0 for r in got["indexer"])
    assert is_streamed(streamed)


def test_cli_compare_dump_streams_under_device_auto_and_refuses_bad_loading(setup, tmp_path, run_cli):
    import json

    _, streamed, _, _, faulty, ckpt = setup
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        "indexer", "compare-dump", str(faulty), "--model", str(ckpt), "--chunk", str(CHUNK),
        "--device", "auto", "--max-memory", "4MiB", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err  # 4 MiB is below the weights: placed, it would have been refused
    result = json.loads((out / "compare_dump.json").read_text())
    validate_compare_dump(result)
    # the CLI's reference is bf16 (the checkpoint's dtype) against this float64 engine's dump: the
    # same tensors, compared (the verdicts are the float64 tests' business)
    want = compare_dump(streamed, faulty, load_mapping(), chunk=CHUNK)
    assert [t["engine_name"] for t in result["tensors"]] == [t["engine_name"] for t in want["tensors"]]
    assert all(t["verdict"] != "incomparable" for t in result["tensors"]) and "wrote" in stdout
    for bad in (["--stream-layers", "--device", "cpu,cpu"], ["--chunk", "0"]):
        code, _, err = run_cli("indexer", "compare-dump", str(faulty), "--model", str(ckpt), *bad,
                               "--out", str(tmp_path / "bad"))  # fmt: skip
        assert code == 2 and len(err.strip().splitlines()) == 1, err
