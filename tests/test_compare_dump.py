"""``indexer compare-dump``: dumps in SGLang's dumper layout, written from the organism over two TP ranks.

The organism is the engine: ``testing.sglang_dump`` shards every mapped tensor the way tensor
parallelism splits the weights (column-parallel slices, row-parallel partial sums, replicated
outputs) and casts it to bf16. A planted fault (layer 3's attention output projection scaled by
1.25) must be named at its layer and tensor; with no fault every tensor is within budget; the rank
order, the shard rule and the layer mapping each have a test that fails when they are wrong.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.compare_dump import compare_dump  # noqa: E402
from needlescope.dsa.compare_dump_md import validate_compare_dump  # noqa: E402
from needlescope.dsa.dump_mapping import load_mapping, parse_mapping  # noqa: E402
from needlescope.dsa.dump_tokens import group_dump  # noqa: E402
from needlescope.dsa.engine_dump import DumpFile, load_value, merge_shards, parse_stem, scan_dump  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.testing.sglang_dump import write_sglang_dump  # noqa: E402

FAULT = "model.layers.3.self_attn.o_b_proj"
PASSES = [40, 20, 2, 2]  # a prefill in two chunks, then two short passes
TOKENS = sum(PASSES)


@pytest.fixture(scope="module")
def organism():
    model, _, _ = load_bundle("organism", device="cpu")
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(10, 3000, (TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def dumps(organism, ids, tmp_path_factory):
    """(clean dump dir, faulty dump dir), both from the shipped SGLang DeepSeek-V4 mapping."""
    root = tmp_path_factory.mktemp("dumps")
    mapping = load_mapping()
    clean = write_sglang_dump(organism, ids, root / "clean", mapping=mapping, passes=PASSES, index_topk=8)
    handle = organism.get_submodule(FAULT).register_forward_hook(lambda m, i, o: o * 1.25)
    try:
        faulty = write_sglang_dump(
            organism, ids, root / "faulty", mapping=mapping, passes=PASSES, index_topk=8
        )
    finally:
        handle.remove()
    return clean, faulty


def _relabel(src: Path, dst: Path, rename) -> Path:
    """A copy of a dump with each file's tags passed through ``rename(tags) -> tags``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        tags = rename(parse_stem(f.stem))
        shutil.copy(f, dst / ("___".join(f"{k}={v}" for k, v in tags.items()) + f.suffix))
    return dst


def _mapping(tmp_path: Path, body: str):
    path = tmp_path / "map.toml"
    path.write_text(body)
    return load_mapping(path)


def test_clean_dump_every_tensor_within_budget(organism, dumps):
    result = compare_dump(organism, dumps[0], load_mapping())
    validate_compare_dump(result)
    assert result["first_beyond"] is None
    assert result["passes"] == [1, 2, 3, 4] and result["ranks"] == [0, 1]
    shards = {t["shard"] for t in result["tensors"]}
    assert {"replicated", "sum", "concat:-1"} <= shards
    assert all(t["verdict"] == "within budget" for t in result["tensors"]), [
        (t["engine_name"], t["rel_err"], t["budget"])
        for t in result["tensors"]
        if t["verdict"] != "within budget"
    ]
    # bf16 activations: not bit-equal to the fp32 reference, yet within the bf16 budget.
    assert all(
        t["rel_err"] > 0 for t in result["tensors"] if t["kind"] == "tensor" and t["layer"] is not None
    )
    assert [r["layer"] for r in result["indexer"]] == [1, 3]
    assert all(r["topk_overlap"] == 1.0 for r in result["indexer"])
    assert result["unknown_names"] == [] and result["missing_reference"] == []


def test_planted_fault_named_at_its_layer_and_tensor(organism, dumps):
    result = compare_dump(organism, dumps[1], load_mapping())
    first = result["first_beyond"]
    assert first == {
        "engine_name": "non_intrusive__model.layers.3.self_attn.wo_b.output",
        "reference": FAULT,
        "layer": 3,
    }
    by_layer = {d["layer"]: d for d in result["layers"]}
    assert [by_layer[i]["beyond"] for i in (0, 1, 2)] == [0, 0, 0]
    row = next(t for t in result["tensors"] if t["reference"] == FAULT)
    assert row["rel_err"] > row["budget"]


def test_ranks_merged_in_rank_order_never_file_order():
    # Twelve shards handed over shuffled (and with ranks 10, 11 that sort before 2 as text).
    whole = torch.arange(12 * 3, dtype=torch.float32).reshape(1, 36)
    shards = list(enumerate(whole.chunk(12, dim=-1)))
    shuffled = [shards[i] for i in (11, 3, 10, 0, 7, 2, 1, 9, 4, 8, 6, 5)]
    assert torch.equal(merge_shards(shuffled, "concat:-1"), whole)
    partial = [(r, torch.full((2,), float(r))) for r in (1, 0)]
    assert torch.equal(merge_shards(partial, "sum"), torch.full((2,), 1.0))


def test_swapped_rank_labels_are_caught(organism, dumps, tmp_path):
    """The same files with ranks 0 and 1 swapped: the first column-parallel tensor goes beyond budget."""
    swapped = _relabel(dumps[0], tmp_path / "swapped", lambda t: {**t, "rank": str(1 - int(t["rank"]))})
    result = compare_dump(organism, swapped, load_mapping())
    assert result["first_beyond"]["engine_name"] == "non_intrusive__model.layers.0.self_attn.wq_b.output"
    replicated = [t for t in result["tensors"] if t["shard"] == "replicated" and t["kind"] == "tensor"]
    assert replicated[0]["verdict"] == "within budget"  # rank order does not matter to a replicated tensor


def test_rank_split_rule_matters(organism, dumps, tmp_path):
    """Declaring a column-parallel output replicated, or a row-parallel partial sum replicated, is caught."""
    mapping = _mapping(
        tmp_path,
        """
[[tensor]]
engine = "non_intrusive__model.layers.{layer}.self_attn.wq_b.output"
reference = "model.layers.{layer}.self_attn.q_b_proj"
shard = "replicated"
[[tensor]]
engine = "non_intrusive__model.layers.{layer}.mlp.shared_experts.down_proj.output"
reference = "model.layers.{layer}.mlp.shared_experts.down_proj"
shard = "replicated"
""",
    )
    result = compare_dump(organism, dumps[0], mapping)
    verdicts = {(t["engine_name"].split(".")[-3], t["layer"]): t["verdict"] for t in result["tensors"]}
    assert verdicts[("self_attn", 0)] == "incomparable"  # one rank's half of the features
    assert verdicts[("shared_experts", 0)] == "beyond budget"  # one rank's partial sum
    assert "could not be compared" in result["summary"]
    # Names the mapping does not know are listed, never dropped.
    assert "non_intrusive__model.layers.0.self_attn.wo_b.output" in result["unknown_names"]


def test_layer_mapping_from_layer_id_tags(organism, dumps, tmp_path):
    """``indexer_topk`` carries its layer only in the layer_id tag: swapped tags are caught, a missing one listed."""
    swap = {"1": "3", "3": "1"}

    def rename(t):
        if t["name"] == "indexer_topk":
            return {**t, "layer_id": swap[t["layer_id"]]}
        return t

    swapped = _relabel(dumps[0], tmp_path / "swapped", rename)
    only_topk = """
[[tensor]]
engine = "indexer_topk"
reference = "model.layers.{layer}.self_attn.compressor.indexer"
kind = "topk"
"""
    result = compare_dump(organism, swapped, _mapping(tmp_path, only_topk))
    assert [r["layer"] for r in result["indexer"]] == [1, 3]
    assert all(r["topk_overlap"] < 0.9 for r in result["indexer"])
    assert result["first_beyond"]["engine_name"] == "indexer_topk"

    def drop_layer(t):  # layer 3's top-k loses its layer_id tag
        return {
            k: v for k, v in t.items() if not (t["name"] == "indexer_topk" and k == "layer_id" and v == "3")
        }

    untagged = _relabel(dumps[0], tmp_path / "untagged", drop_layer)
    with_wq_a = (
        only_topk
        + """
[[tensor]]
engine = "non_intrusive__model.layers.{layer}.self_attn.wq_a.output"
reference = "model.layers.{layer}.self_attn.q_a_proj"
"""
    )
    result = compare_dump(organism, untagged, _mapping(tmp_path, with_wq_a))
    assert result["names_without_layer"] == ["indexer_topk"]
    assert [r["layer"] for r in result["indexer"]] == [1]
    assert result["first_beyond"] is None


def test_dump_layout_and_refusals(dumps, tmp_path):
    files = scan_dump(dumps[0].parent)  # the experiment subdirectory is found
    assert {f.pass_id for f in files} == {1, 2, 3, 4} and {f.rank for f in files} == {0, 1}
    tagged = next(f for f in files if f.name.endswith("layers.2.self_attn.wq_b.output"))
    assert tagged.layer == 2 and tagged.tags["recompute_status"] == "disabled"
    value, meta = load_value(tagged.path)
    assert value.dtype == torch.bfloat16 and meta["world_size"] == 2
    # A pickle holding anything but tensors is refused (weights_only=True), never unpickled.
    evil = tmp_path / "step=1___rank=0___dump_index=1___name=x.pt"
    torch.save({"value": Path("/")}, evil)
    with pytest.raises(BadInput, match="weights_only=True"):
        load_value(evil)
    with pytest.raises(BadInput, match="shard"):
        parse_mapping('[[tensor]]\nengine = "a"\nreference = "b"\nshard = "split"\n', "m.toml")
    # A name compared with nothing may repeat in a pass (a module called twice); a compared one may not.
    mapping = parse_mapping('[[tensor]]\nengine = "a"\nreference = "b"\n', "m.toml")
    twice = [DumpFile(Path(f"{n}{i}.pt"), 1, 0, n, i, None) for n in ("x", "a") for i in (1, 2)]
    assert group_dump(twice[:2], mapping).unknown == ["x"]
    with pytest.raises(BadInput, match="twice for pass 1"):
        group_dump(twice, mapping)


def test_cli_writes_report_and_refuses_bad_input(dumps, tmp_path, run_cli):
    """The real entry point, in-process (``run_cli``): a BadInput is one line and exit 2."""
    code, _, err = run_cli("indexer", "compare-dump", str(tmp_path / "none"), "--model", "organism",
                           "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        "indexer", "compare-dump", str(dumps[1]), "--model", "organism", "--out", str(out)
    )
    assert code == 1, err  # a tensor beyond its budget is a finding (issue 54: it was exit 0)
    assert "layers.3.self_attn.wo_b.output" in stdout
    assert "First tensor beyond its precision budget" in (out / "compare_dump.md").read_text()
    assert (out / "compare_dump.json").is_file()


def _as_sglang_writes(src: Path, dst: Path, meta_extra: dict | None = None) -> Path:
    """A copy of a dump as SGLang's ``_Dumper._dump_single`` writes it (read in sglang's
    ``debug_utils/dumper.py``): the first forward pass is ``step=0``; with
    ``DUMPER_INCLUDE_PARALLEL_RANK_IN_FILENAME`` the stem ends in ``___pp_rank=0___tp_rank=R``; the
    meta carries ``sglang_parallel_info``; the root module also dumps its positional inputs
    (``non_intrusive__inputs.0``) and the ForwardBatch's ``seq_lens`` and ``rids`` (a list of
    strings, not a tensor)."""
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir(), key=lambda p: parse_stem(p.stem)["dump_index"]):
        tags = parse_stem(f.stem)
        value, meta = load_value(f)
        tags["step"] = int(tags["step"]) - 1
        tags.update(pp_rank=0, tp_rank=tags["rank"])
        info = {"tp_rank": int(tags["rank"]), "tp_size": 2, "pp_rank": 0, "pp_size": 1, "attn_dp_size": 1,
                "enable_dp_attention": False, **(meta_extra or {})}  # fmt: skip
        extra = [] if tags["name"] != "input_ids" or "layer_id" in tags else [
            ("non_intrusive__inputs.0", value), ("seq_lens", torch.tensor([len(value)])), ("rids", ["req-0"])]  # fmt: skip
        for name, v in [(tags["name"], value), *extra]:
            stem = "___".join(f"{k}={v_}" for k, v_ in {**tags, "name": name}.items())
            full = {
                **meta,
                **tags,
                "name": name,
                "world_rank": int(tags["rank"]),
                "sglang_parallel_info": info,
            }
            torch.save({"value": v, "meta": full}, dst / f"{stem}.pt")
    return dst


def test_reads_what_sglangs_dumper_writes(organism, dumps, tmp_path):
    """The token fields are dumped again by every layer that takes them as keywords (the writer
    does this too); root inputs, seq_lens and rids are ignored by the mapping, never loaded."""
    mapping = load_mapping()
    real = _as_sglang_writes(dumps[1], tmp_path / "dump_20261206_120000_000123")
    files = scan_dump(tmp_path)
    assert {f.pass_id for f in files} == {0, 1, 2, 3} and {f.rank for f in files} == {0, 1}
    assert sum(f.name == "positions" and f.layer is not None for f in files) > 0
    got, want = compare_dump(organism, real, mapping), compare_dump(organism, dumps[1], mapping)
    assert got["tensors"] == want["tensors"] and got["first_beyond"] == want["first_beyond"]
    assert not got["unknown_names"]
    assert {"rids", "seq_lens", "non_intrusive__inputs.0"} <= set(got["ignored_names"])
    pipelined = _as_sglang_writes(dumps[1], tmp_path / "pp", {"pp_size": 2})
    with pytest.raises(BadInput, match="pipeline parallelism"):
        compare_dump(organism, pipelined, mapping)


def test_batch_of_one_dump_reads_as_its_tokens(organism, dumps, tmp_path):
    """A transformers model under SGLang's dumper dumps [1, tokens, ...] (tests/test_sglang_own.py);
    the same values with that leading 1 give the same comparison."""
    dst = tmp_path / "batched"
    dst.mkdir()
    for f in dumps[1].iterdir():
        value, meta = load_value(f)
        name = parse_stem(f.stem)["name"]
        batched = value if name in ("input_ids", "positions") or value.dim() < 2 else value[None]
        torch.save({"value": batched, "meta": meta}, dst / f.name)
    got, want = compare_dump(organism, dst, load_mapping()), compare_dump(organism, dumps[1], load_mapping())
    assert got["tensors"] == want["tensors"] and got["first_beyond"] == want["first_beyond"]
