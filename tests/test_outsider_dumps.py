"""Bugs an outsider found reading checkpoints and engine dumps, one regression test each.

Checkpoints: a sharded copy of the organism with its index or shards damaged the ways a copy goes
wrong (a shard missing, an index that is not JSON, that lies about which shard holds a tensor or
points outside the directory, shards without an index, a layer missing, a tensor of the wrong
shape). Each must be one line and exit 2 on both loaders (in memory through transformers, and
streamed), never a traceback, and never a run on random weights.

Dumps (SGLang's dumper layout, two TP ranks, written from the organism): shards that do not join,
a partial sum short of a rank, an fp8 dumped tensor, an unreadable file, a hostile meta and
negative positions. A dump that is incomplete must be reported as such, never judged as the
engine's numerical error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from needlescope.dsa.checkpoint import load_bundle, shipped_dir  # noqa: E402
from needlescope.dsa.compare_dump import compare_dump  # noqa: E402
from needlescope.dsa.dump_mapping import load_mapping  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.testing.sglang_dump import write_sglang_dump  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
LOADERS = [(), ("--stream-layers",)]


def _one_line_bad_input(code: int, err: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error:"), err


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The organism saved as two shards with an index (as save_pretrained shards a large model)."""
    src, dst = shipped_dir(), tmp_path_factory.mktemp("ckpt") / "sharded"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    sd = load_file(src / "model.safetensors")
    names = sorted(sd)
    weight_map = {}
    for i, shard in enumerate(SHARDS):
        save_file({k: sd[k].contiguous() for k in names[i::2]}, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names[i::2], shard))
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _copy(sharded: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sharded, tmp_path / "ckpt"))


def _rank_dump(run_cli, model: Path, tmp_path: Path, *extra: str):
    return run_cli(
        "indexer", "rank-dump", "--model", str(model), "--prompt", str(EXAMPLES / "chat.json"),
        "--needle-span", "5:8", "--out", str(tmp_path / "rd"), *extra,
    )  # fmt: skip


def _edit_index(ckpt: Path, edit) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    edit(index["weight_map"])
    (ckpt / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("extra", LOADERS)
def test_an_index_naming_a_missing_shard_is_bad_input(sharded, tmp_path, run_cli, extra):
    ckpt = _copy(sharded, tmp_path)
    (ckpt / SHARDS[1]).unlink()
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path, *extra)
    _one_line_bad_input(code, err)
    assert SHARDS[1] in err and "not a file" in err


@pytest.mark.parametrize("extra", LOADERS)
def test_an_index_that_is_not_json_is_bad_input(sharded, tmp_path, run_cli, extra):
    ckpt = _copy(sharded, tmp_path)
    (ckpt / INDEX).write_text("{not json")
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path, *extra)
    _one_line_bad_input(code, err)
    assert INDEX in err and "not readable JSON" in err


def test_an_index_with_a_weight_map_that_is_no_mapping_is_bad_input(sharded, tmp_path, run_cli):
    ckpt = _copy(sharded, tmp_path)
    (ckpt / INDEX).write_text(json.dumps({"weight_map": [1, 2]}))
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path)
    _one_line_bad_input(code, err)
    assert "weight_map" in err


@pytest.mark.parametrize("extra", LOADERS)
def test_an_index_placing_a_tensor_in_the_wrong_shard_is_bad_input(sharded, tmp_path, run_cli, extra):
    ckpt = _copy(sharded, tmp_path)

    def swap(wm):
        wm["model.norm.weight"] = SHARDS[1] if wm["model.norm.weight"] == SHARDS[0] else SHARDS[0]

    _edit_index(ckpt, swap)
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path, *extra)
    _one_line_bad_input(code, err)
    assert "'model.norm.weight'" in err and "do not hold them" in err


def test_an_index_naming_a_shard_outside_the_directory_is_refused(sharded, tmp_path, run_cli):
    """The weights would come from a file nobody checked (here another checkpoint's shard)."""
    ckpt = _copy(sharded, tmp_path)
    _edit_index(ckpt, lambda wm: wm.update({"model.norm.weight": f"../../{sharded.name}/{SHARDS[0]}"}))
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path, "--stream-layers")
    _one_line_bad_input(code, err)
    assert "not a file in" in err and not (tmp_path / "rd" / "rankdump.json").exists()


@pytest.mark.parametrize("extra", LOADERS)
def test_one_tensor_in_two_unindexed_shards_is_refused_not_picked(sharded, tmp_path, run_cli, extra):
    """Without an index, the streamed loader took whichever shard came last: a silent choice."""
    ckpt = _copy(sharded, tmp_path)
    (ckpt / INDEX).unlink()
    first, second = load_file(ckpt / SHARDS[0]), load_file(ckpt / SHARDS[1])
    name = next(iter(first))
    second[name] = torch.full_like(first[name], 7.0)
    save_file(second, ckpt / SHARDS[1])
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path, *extra)
    _one_line_bad_input(code, err)
    assert repr(name) in err and "in both" in err


def test_shards_without_an_index_are_bad_input_in_memory(sharded, tmp_path, run_cli):
    ckpt = _copy(sharded, tmp_path)
    (ckpt / INDEX).unlink()
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path)
    _one_line_bad_input(code, err)
    assert INDEX in err


def _one_file(tmp_path: Path, edit) -> Path:
    ckpt = Path(shutil.copytree(shipped_dir(), tmp_path / "ckpt"))
    sd = load_file(ckpt / "model.safetensors")
    save_file(edit(sd), ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def test_a_checkpoint_missing_a_layer_is_refused_not_run_on_random_weights(tmp_path, run_cli):
    """The default (in memory) loader let transformers initialise layer 2 at random and ran on."""
    ckpt = _one_file(
        tmp_path, lambda sd: {k: v for k, v in sd.items() if not k.startswith("model.layers.2.")}
    )
    code, out, err = _rank_dump(run_cli, ckpt, tmp_path)
    _one_line_bad_input(code, err)
    assert "lack" in err and "model.layers.2." in err
    assert "LOAD REPORT" not in err + out and not (tmp_path / "rd" / "rankdump.json").exists()


def test_a_tensor_of_the_wrong_shape_is_bad_input_in_memory(tmp_path, run_cli):
    ckpt = _one_file(tmp_path, lambda sd: {**sd, "model.norm.weight": sd["model.norm.weight"][:-1].clone()})
    code, _, err = _rank_dump(run_cli, ckpt, tmp_path)
    _one_line_bad_input(code, err)
    assert "'model.norm.weight'" in err and "shape" in err


# --- engine dumps --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def organism():
    return load_bundle("organism", device="cpu")[0]


@pytest.fixture(scope="module")
def dump(organism, tmp_path_factory) -> Path:
    ids = torch.randint(10, 3000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    root = tmp_path_factory.mktemp("dump")
    return write_sglang_dump(organism, ids, root / "d", mapping=load_mapping(), passes=[16, 8], index_topk=8)


def _variant(dump: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dump, tmp_path / "dump"))


def _files(d: Path, part: str, rank: int | None = None, step: int | None = None) -> list[Path]:
    return sorted(
        p
        for p in d.iterdir()
        if part in p.name
        and (rank is None or f"___rank={rank}___" in p.name)
        and (step is None or p.name.startswith(f"step={step}___"))
    )


def _edit(p: Path, fn) -> None:
    obj = torch.load(p, weights_only=True)
    obj["value"] = fn(obj["value"])
    torch.save(obj, p)


def _row(result: dict, part: str) -> dict:
    return next(t for t in result["tensors"] if part in t["engine_name"])


WQ_B0 = "model.layers.0.self_attn.wq_b.output"  # concat:-1
DOWN0 = "model.layers.0.mlp.shared_experts.down_proj.output"  # sum


@pytest.mark.parametrize("name", [WQ_B0, DOWN0])
def test_shards_that_do_not_join_are_incomparable_not_a_traceback(organism, dump, tmp_path, name):
    d = _variant(dump, tmp_path)
    _edit(_files(d, name, rank=1, step=1)[0], lambda v: v[:-1])  # one token short on rank 1
    result = compare_dump(organism, d, load_mapping())
    row = _row(result, name)
    assert row["verdict"] == "incomparable" and "pass 1" in row["reason"], row
    assert result["first_beyond"] is None


def test_a_partial_sum_short_of_a_rank_is_incomparable_never_the_engines_error(organism, dump, tmp_path):
    """Rank 0's partial sum alone was judged 'beyond budget' and named as the first faulty tensor."""
    d = _variant(dump, tmp_path)
    for p in _files(d, DOWN0, rank=1):
        p.unlink()
    result = compare_dump(organism, d, load_mapping())
    row = _row(result, DOWN0)
    assert row["verdict"] == "incomparable" and "rank(s) [1]" in row["reason"], row
    assert result["first_beyond"] is None


@pytest.mark.parametrize(
    ("dtype", "name"), [(torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2")]
)
def test_an_fp8_dumped_tensor_is_judged_at_fp8(organism, dump, tmp_path, dtype, name):
    """A tensor dumped in fp8 was a NotImplementedError traceback (e5m2 too, after e4m3 was fixed)."""
    d = _variant(dump, tmp_path)
    for p in _files(d, "self_attn.wq_a.output"):
        _edit(p, lambda v: v.to(dtype))
    result = compare_dump(organism, d, load_mapping())
    row = _row(result, "model.layers.0.self_attn.wq_a.output")
    assert row["precision"] == name and row["verdict"] == "within budget", row


def test_an_unreadable_safetensors_dump_file_is_bad_input(organism, dump, tmp_path):
    d = _variant(dump, tmp_path)
    p = _files(d, "model.layers.0.self_attn.wq_a.output", rank=0, step=1)[0]
    value = torch.load(p, weights_only=True)["value"]
    p.unlink()
    st = p.with_suffix(".safetensors")
    save_file({"value": value.contiguous()}, st)
    st.write_bytes(st.read_bytes()[:-10])  # truncated mid-copy
    with pytest.raises(BadInput, match="not a readable safetensors file"):
        compare_dump(organism, d, load_mapping())


def test_a_parallel_size_that_is_not_an_integer_is_bad_input(organism, dump, tmp_path):
    d = _variant(dump, tmp_path)
    for p in d.iterdir():
        obj = torch.load(p, weights_only=True)
        obj["meta"]["sglang_parallel_info"]["pp_size"] = "x"
        torch.save(obj, p)
    with pytest.raises(BadInput, match="pp_size='x' is not an integer"):
        compare_dump(organism, d, load_mapping())


def test_negative_positions_are_bad_input_not_rows_from_the_end(organism, dump, tmp_path):
    """Position -1 indexed the reference's last row: the embedding was named beyond budget."""
    d = _variant(dump, tmp_path)
    for p in _files(d, "name=positions"):
        _edit(p, lambda v: v - 1)
    with pytest.raises(BadInput, match="positions include -1"):
        compare_dump(organism, d, load_mapping())


def test_a_mapping_may_name_every_precision_the_comparison_has_a_budget_for():
    from needlescope.dsa.compare_dump import PRECISION_U
    from needlescope.dsa.dump_mapping import PRECISIONS

    assert set(PRECISIONS) == set(PRECISION_U)
