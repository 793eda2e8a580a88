"""``dsa.attention.blocked_attention`` against transformers' eager attention on the organism."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import transformers.models.deepseek_v4.modeling_deepseek_v4 as modeling  # noqa: E402

from needlescope.dsa import attention  # noqa: E402
from needlescope.dsa.attention import NAME  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402


@pytest.fixture(scope="module")
def organism64():
    model, _, _ = load_bundle("organism")
    model = model.double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


def _logits(model, ids, impl):
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model(input_ids=ids, logits_to_keep=torch.arange(ids.shape[1])).logits
    finally:
        model.set_attn_implementation(NAME)


def test_loaded_models_use_it_and_every_position_equals_eager(organism64, monkeypatch):
    assert organism64.config._attn_implementation == NAME
    monkeypatch.setattr(attention, "BLOCK", 48)  # 300 tokens: seven blocks, the last one short
    ids = torch.randint(
        10, organism64.config.vocab_size - 10, (2, 300), generator=torch.Generator().manual_seed(0)
    )
    eager, blocked = _logits(organism64, ids, "eager"), _logits(organism64, ids, NAME)
    torch.testing.assert_close(blocked, eager, rtol=0, atol=1e-10)


def test_a_patched_eager_function_is_what_runs(organism64, monkeypatch):
    """A patch that replaces transformers' eager attention (a planted bug) is never bypassed."""
    monkeypatch.setattr(attention, "BLOCK", 48)
    calls = []
    original = modeling.eager_attention_forward

    def planted(*args, **kwargs):
        calls.append(args[1].shape[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", planted)
    ids = torch.randint(10, 3000, (1, 200), generator=torch.Generator().manual_seed(1))
    _logits(organism64, ids, NAME)
    assert calls == [200] * organism64.config.num_hidden_layers
