"""Patches written the way monkeypatches are (replace a forward, change a weight in place, swap
a class attribute or a modeling-file function, return nothing) run any number of times on one
model: each application is undone from a pristine copy (``dsa.pristine``), bit for bit."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

MONKEYPATCH = """
import transformers.models.deepseek_v4.modeling_deepseek_v4 as m


def apply(model):
    attn = model.get_submodule("model.layers.3.self_attn")
    inner = attn.o_b_proj.forward
    attn.o_b_proj.forward = lambda x: -inner(x)        # a module's forward, replaced
    model.lm_head.weight.data.mul_(1.5)                # a weight, changed in place
    m.DeepseekV4Indexer.planted_flag = True             # a class attribute, added
    good = m.apply_rotary_pos_emb
    m.apply_rotary_pos_emb = lambda x, c, s, unsqueeze_dim=1: good(x, c, -s, unsqueeze_dim)
"""


@pytest.fixture(scope="module")
def organism():
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle("organism")[0]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_monkeypatch_without_undo_applies_again_and_again(organism, tmp_path, caplog):
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as m

    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.emulate import emulate, patched_for_good, patches_applied
    from needlescope.setting import PatchRef, Setting

    patch = tmp_path / "monkey.py"
    patch.write_text(MONKEYPATCH)
    ids = torch.tensor([list(range(5, 200))])
    clean = _logits(organism, ids)
    rope = m.apply_rotary_pos_emb
    patched = []
    with caplog.at_level(logging.WARNING, logger="needlescope.dsa"):
        for _ in range(2):  # as a setting's patch, twice (the second was refused before)
            with emulate(organism, Setting(patch=PatchRef.resolve(patch))):
                patched.append(_logits(organism, ids))
            assert torch.equal(_logits(organism, ids), clean)
        with patches_applied(organism, [PatchRef.resolve(patch)]):  # as an extra patch
            patched.append(_logits(organism, ids))
    assert all(torch.equal(p, patched[0]) for p in patched)  # it acted the same each time ...
    assert not torch.allclose(patched[0], clean)
    # ... and left nothing behind: weights as loaded, the class and the modeling file restored
    assert patched_for_good(organism) is None
    assert m.apply_rotary_pos_emb is rope and not hasattr(m.DeepseekV4Indexer, "planted_flag")
    fresh = load_bundle("organism")[0]
    assert all(torch.equal(a, b) for a, b in zip(organism.state_dict().values(), fresh.state_dict().values()))
    (line,) = [r.getMessage() for r in caplog.records if "returned no undo" in r.getMessage()]  # once
    assert "pristine copy" in line and "MB" in line, line


def test_a_patch_that_fails_midway_leaves_the_model_as_loaded(organism, tmp_path):
    from needlescope.dsa.emulate import apply_patch_once
    from needlescope.errors import BadInput

    patch = tmp_path / "half.py"
    patch.write_text(
        "def apply(model):\n    model.lm_head.weight.data.zero_()\n    raise RuntimeError('boom')\n"
    )
    before = organism.lm_head.weight.detach().clone()
    with pytest.raises(BadInput, match="boom"):
        apply_patch_once(organism, str(patch))
    assert torch.equal(organism.lm_head.weight, before)


BEYOND_THE_MODEL = """
import torch
import transformers.models.deepseek_v4.modeling_deepseek_v4 as m


def apply(model):
    good = torch.Tensor.topk

    def lowest(self, k, *args, **kwargs):                # the indexer keeps its lowest scores
        return good(-self, k, *args, **kwargs)

    torch.Tensor.topk = lowest                            # an inherited method, overridden
    m.ALL_ATTENTION_FUNCTIONS["planted"] = lambda *a, **k: None   # a registry entry
    model.config.sliding_window = 8                       # the config every forward reads
"""


def test_a_no_undo_patch_beyond_the_model_is_undone_too(organism, tmp_path):
    """What a patch changes outside the model's modules and weights (a torch class, a
    transformers registry, the config object) was not kept: ``Tensor.topk`` stayed overridden,
    the registry kept its entry and the window stayed 8 in every later configuration."""
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as m

    from needlescope.dsa.emulate import patches_applied
    from needlescope.setting import PatchRef

    patch = tmp_path / "beyond.py"
    patch.write_text(BEYOND_THE_MODEL)
    ids = torch.tensor([list(range(5, 200))])
    clean = _logits(organism, ids)
    window = organism.config.sliding_window
    assert window != 8
    for _ in range(2):
        with patches_applied(organism, [PatchRef.resolve(patch)]):
            assert organism.config.sliding_window == 8 and "topk" in vars(torch.Tensor)
            assert not torch.allclose(_logits(organism, ids), clean)
        assert "topk" not in vars(torch.Tensor) and "planted" not in m.ALL_ATTENTION_FUNCTIONS
        assert organism.config.sliding_window == window
        assert torch.equal(_logits(organism, ids), clean)
