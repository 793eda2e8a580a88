"""``config.json`` against the weights beside it (issue 54, items 4 and 7): every loader runs
``dsa.consistency.check_checkpoint`` before building a model, so a config naming fewer layers
than the weights hold, or a hostile size field, is one BadInput line (exit 2 on the command
line) before any allocation, the same from the in-memory loader and from ``--stream-layers``."""

from __future__ import annotations

import json
import resource

import pytest

pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle, shipped_dir  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402

LOADERS = [pytest.param(False, id="in-memory"), pytest.param(True, id="stream-layers")]


def _organism_with(tmp_path, **changes):
    """The shipped organism with ``config.json`` fields changed (weights linked, not copied)."""
    src, out = shipped_dir(), tmp_path / "ckpt"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(autouse=True)
def _bounded_memory():
    """Old code allocated many GiB for these configs; keep a failing run from taking the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("stream", LOADERS)
def test_a_config_naming_fewer_layers_than_the_weights_is_refused_by_every_loader(tmp_path, stream):
    config = json.loads((shipped_dir() / "config.json").read_text())
    path = _organism_with(
        tmp_path,
        num_hidden_layers=3,
        layer_types=config["layer_types"][:3],
        mlp_layer_types=config["mlp_layer_types"][:3],
    )
    with pytest.raises(
        BadInput, match=r"num_hidden_layers 3 but the weights hold 5 decoder layer\(s\) \(layers 0..4\)"
    ):
        load_bundle(path, stream_layers=stream)


HOSTILE = [
    ("num_hidden_layers", 0, "num_hidden_layers is 0; it must be a positive integer"),
    ("num_hidden_layers", -1, "num_hidden_layers is -1; it must be a positive integer"),
    ("num_hidden_layers", 2.5, "num_hidden_layers is 2.5"),
    ("num_attention_heads", 0, "num_attention_heads is 0"),
    ("hidden_size", 1_000_000, r"implies at least [\d,]+ parameters .* but the weights hold [\d,]+ values"),
    ("vocab_size", 2_000_000_000, r"\(embedding: 768,000,000,000\)"),
]


@pytest.mark.parametrize("stream", LOADERS)
@pytest.mark.parametrize(("field", "value", "said"), HOSTILE, ids=[f"{f}={v}" for f, v, _ in HOSTILE])
def test_hostile_config_sizes_are_one_line_before_any_allocation(tmp_path, stream, field, value, said):
    path = _organism_with(tmp_path, **{field: value})
    with pytest.raises(BadInput, match=said) as caught:
        load_bundle(path, stream_layers=stream)
    assert "\n" not in str(caught.value) and "restore the config.json" in str(caught.value)


def test_the_shipped_config_passes_and_its_bound_is_below_what_is_stored():
    from needlescope.dsa.consistency import check_checkpoint, implied_parameters, stored_elements
    from needlescope.dsa.loading import checkpoint_tensors

    path = shipped_dir()
    files = checkpoint_tensors(path)
    check_checkpoint(path, files)  # no BadInput
    parts = implied_parameters(json.loads((path / "config.json").read_text()))
    assert 0 < sum(parts.values()) <= stored_elements(files)


def test_cli_refuses_a_hostile_config_in_one_line_with_exit_2(tmp_path, run_cli):
    path = _organism_with(tmp_path, vocab_size=2_000_000_000)
    code, _, err = run_cli("audit", "--model", str(path), "--stream-layers", "--checks", "routed_scale")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "vocab_size 2000000000" in err
