"""Issue 54, item 6: hostile dumps in ``indexer compare-dump`` are one line, exit 2.

A few-hundred-byte zero-stride shard was materialized to gigabytes before it was found not to
fit; positions shifted far past the context built a sequence of that many tokens (2e8: over
200 s); ids outside the vocabulary ended in an IndexError. Each shard's size is now checked
against the reference before merging, positions against the model's context and ids against its
vocabulary. The dumps are the organism's own (``testing.sglang_dump``), then tampered with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.compare_dump import compare_dump  # noqa: E402
from needlescope.dsa.dump_mapping import load_mapping  # noqa: E402
from needlescope.dsa.engine_dump import load_value, parse_stem  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.testing.sglang_dump import write_sglang_dump  # noqa: E402

PASSES = [10, 2]


@pytest.fixture(scope="module")
def organism():
    return load_bundle("organism", device="cpu")[0]


@pytest.fixture(scope="module")
def clean(organism, tmp_path_factory):
    ids = torch.randint(10, 3000, (sum(PASSES),), generator=torch.Generator().manual_seed(0)).tolist()
    return write_sglang_dump(organism, ids, tmp_path_factory.mktemp("clean"), mapping=load_mapping(),
                             passes=PASSES, index_topk=8)  # fmt: skip


def _tampered(clean: Path, dst: Path, name: str, change, *, first_only: bool = False) -> Path:
    """A copy of the dump whose files of ``name`` hold ``change(value)`` (only the first such file
    when ``first_only``), saved as the dumper saves them."""
    shutil.copytree(clean, dst)
    for f in sorted(dst.iterdir(), key=lambda p: int(parse_stem(p.stem)["dump_index"])):
        if parse_stem(f.stem)["name"] == name:
            value, meta = load_value(f)
            torch.save({"value": change(value), "meta": meta}, f)
            if first_only:
                break
    return dst


def test_a_zero_stride_shard_is_refused_before_it_is_merged(clean, tmp_path, run_cli):
    name = next(parse_stem(p.stem)["name"] for p in sorted(clean.iterdir()) if "wq_b" in p.stem)
    # A few hundred bytes on disk, 2**26 values once merged (the took 5 GiB).
    dump = _tampered(clean, tmp_path / "zero", name, lambda v: v.new_zeros(1).expand(v.shape[0], 2**26 // v.shape[0]),
                     first_only=True)  # fmt: skip
    assert min(p.stat().st_size for p in dump.iterdir()) < 4096
    code, stdout, stderr = run_cli("indexer", "compare-dump", str(dump), "--model", "organism",
                                   "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 2, stdout + stderr
    assert len(stderr.strip().splitlines()) == 1 and "values), more than the reference's" in stderr, stderr
    assert "nothing was merged" in stderr


def test_positions_past_the_context_are_refused(organism, clean, tmp_path):
    dump = _tampered(clean, tmp_path / "shifted", "positions", lambda v: v + 10**6)
    with pytest.raises(
        BadInput, match=r"positions reach 100000\d+, beyond the model's context of 8192 tokens"
    ):
        compare_dump(organism, dump, load_mapping())


def test_ids_outside_the_vocabulary_are_refused(organism, clean, tmp_path):
    dump = _tampered(clean, tmp_path / "oov", "input_ids", lambda v: v + 10**6)
    with pytest.raises(BadInput, match=r"input_ids include 100\d+, outside the model's vocabulary 0\.\.3119"):
        compare_dump(organism, dump, load_mapping())


def test_a_token_field_of_more_values_than_the_context_is_refused_unread(organism, clean, tmp_path):
    dump = _tampered(
        clean, tmp_path / "wide", "positions", lambda v: v.new_zeros(1).expand(2**30), first_only=True
    )
    with pytest.raises(BadInput, match=r"1073741824 positions in pass \d+, more than the model's context"):
        compare_dump(organism, dump, load_mapping())
