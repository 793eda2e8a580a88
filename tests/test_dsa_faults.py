"""Built-in indexer faults: name resolution, exact semantics on a real DeepSeek-V4 model, undo."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.emulate import IndexerCapture, csa_indexers, emulate  # noqa: E402
from needlescope.dsa.faults import fault_names, resolve_patch  # noqa: E402
from needlescope.dsa.faults.indexer_page_table import scrambled_slots  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.setting import Setting, serving_fault_names  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

SCORER_FAULTS = ["indexer_fp8_no_scale", "indexer_key_positions", "indexer_key_slot", "indexer_page_table"]
FAULTS = [*SCORER_FAULTS, "indexer_topk_overflow"]  # the last one leaves the scores alone
T = 160  # 40 compressed entries: pages 0 and 1 swap, the partial page 2 stays


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_random(
        tmp_path_factory.mktemp("faults") / "m", seed=0, hidden_size=64, moe_intermediate_size=64
    )
    m, _, _ = load_bundle(path)
    return m


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 3000, (1, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _last_row_scores(model, patch=None) -> dict[int, torch.Tensor]:
    """Per CSA layer, the fp8 indexer scores of the last prompt position (every entry visible)."""
    cap = IndexerCapture(keep_scores=True)
    with emulate(model, Setting(index_k="fp8_e4m3", index_topk=4, patch=patch), capture=cap) as layers:
        model(_ids())
    return {layer: cap.score_rows(layer)[1][-1] for layer in layers}


def test_fault_names_resolve_and_bad_names_say_what_exists(tmp_path):
    assert [n for n in fault_names() if n not in serving_fault_names()] == FAULTS  # serve's: its own test
    assert resolve_patch("fault:indexer_page_table").name == "indexer_page_table.py"
    with pytest.raises(BadInput, match="Built-in faults: .*indexer_fp8_no_scale"):
        resolve_patch("fault:indexer_typo")
    with pytest.raises(BadInput, match="does not exist"):
        resolve_patch(tmp_path / "missing.py")


def test_scrambled_slots_swap_complete_page_pairs_only():
    slots = scrambled_slots(40)
    assert sorted(slots.tolist()) == list(range(40))  # a permutation: every key is read once
    assert torch.equal(slots[slots], torch.arange(40))  # its own inverse
    assert slots[:16].tolist() == list(range(16, 32)) and slots[32:].tolist() == list(range(32, 40))
    assert scrambled_slots(20).tolist() == [16, 17, 18, 19, *range(4, 16), 0, 1, 2, 3]


def test_page_table_and_key_slot_faults_score_the_keys_they_claim(model):
    ref = _last_row_scores(model)
    paged = _last_row_scores(model, "fault:indexer_page_table")
    shifted = _last_row_scores(model, "fault:indexer_key_slot")
    # Only the first CSA layer sees the same hidden states: later layers read what the faulty
    # selection let through.
    first = min(ref)
    row = ref[first]
    assert row.shape == (T // 4,)
    torch.testing.assert_close(paged[first], row[scrambled_slots(T // 4)])
    torch.testing.assert_close(shifted[first][1:], row[:-1])
    assert not torch.equal(paged[first], row)


@pytest.mark.parametrize("name", SCORER_FAULTS)
@torch.no_grad()
def test_every_fault_changes_the_scores_and_is_undone(model, name):
    ids = _ids(1)
    before = model(ids).logits
    ref = _last_row_scores(model)
    faulty = _last_row_scores(model, f"fault:{name}")
    assert any(not torch.allclose(faulty[layer], ref[layer]) for layer in ref)
    assert torch.equal(model(ids).logits, before)
    for _, indexer in csa_indexers(model):
        assert "forward" not in indexer.scorer.__dict__ and "forward" not in indexer.rotary_emb.__dict__
