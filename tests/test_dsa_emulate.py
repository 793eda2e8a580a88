"""emulate(): numerics on a real transformers DeepSeek-V4 model, restoration, capture, patches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.emulate import REFERENCE, IndexerCapture, csa_indexers, emulate  # noqa: E402
from needlescope.dsa.quant import get_quantizer, quantize_query_fp8_per_head  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_random(tmp_path_factory.mktemp("emu") / "m", seed=0, hidden_size=64, moe_intermediate_size=64)
    m, _, _ = load_bundle(path)
    return m


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 3000, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_reference_with_capture_leaves_logits_unchanged_and_restores(model):
    ids = _ids(150)
    before = model(ids).logits
    cap = IndexerCapture(keep_scores=True)
    with emulate(model, REFERENCE, capture=cap) as layers:
        same = model(ids).logits
    assert torch.equal(before, same)
    assert layers == [layer for layer, _ in csa_indexers(model)] and cap.layers() == layers
    with emulate(model, Setting(index_k="fp4_e2m1", index_q="fp4_e2m1", index_topk=4)):
        changed = model(ids).logits
    assert not torch.equal(before, changed)
    assert torch.equal(before, model(ids).logits)
    assert all(ix.index_topk == model.config.index_topk for _, ix in csa_indexers(model))


@torch.no_grad()
def test_restores_after_an_error(model):
    with pytest.raises(RuntimeError), emulate(model, Setting(index_k="fp8_e4m3", index_topk=3)):
        raise RuntimeError("boom")
    assert all(ix.index_topk == model.config.index_topk for _, ix in csa_indexers(model))
    assert all("forward" not in ix.scorer.__dict__ for _, ix in csa_indexers(model))


@torch.no_grad()
def test_capture_rows_cover_prefill_and_every_decode_step(model):
    ids = _ids(97, seed=1)
    cap = IndexerCapture()
    with emulate(model, Setting(index_topk=5), capture=cap) as layers:
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    total = out.shape[1]
    for layer in layers:
        pos, rows = cap.rows(layer, 5)
        assert pos.tolist() == list(range(total - 1))  # tokens - 1 rows, as SGLang's capture
        vis = (pos + 1) // 4
        for t, row in zip(pos.tolist(), rows, strict=True):
            chosen = [i for i in row.tolist() if i >= 0]
            assert len(chosen) == min(5, int(vis[t])) and all(i < vis[t] for i in chosen)


@torch.no_grad()
def test_fp8_scores_equal_sglang_folded_query_scales(model):
    """Fake-quantising q per (token, head) equals SGLang folding its scale into the head weights."""
    cap = IndexerCapture(keep_scores=True)
    layer, indexer = csa_indexers(model)[0]
    seen = {}

    def grab(module, args, output):
        seen["q"], seen["k"], seen["h"] = args

    handle = indexer.scorer.register_forward_hook(grab)
    with emulate(model, Setting(index_k="fp8_e4m3", index_q="fp8_e4m3"), capture=cap):
        model(_ids(120, seed=2))
    handle.remove()
    q, k, h = (t[0].float() for t in (seen["q"], seen["k"], seen["h"]))  # [S,H,D], [L,D], [S,hidden]
    w = indexer.scorer.weights_proj(h).float() * indexer.scorer.weights_scaling  # [S, H]
    q_hat, w_folded = quantize_query_fp8_per_head(q, w)
    k_deq = get_quantizer("fp8_e4m3")(k)
    dots = torch.relu(torch.einsum("shd,ld->shl", q_hat, k_deq)) * indexer.scorer.softmax_scale
    folded = (dots * w_folded.unsqueeze(-1)).sum(1)  # [S, L]
    got = next(c for c in cap.calls if c.layer == layer).scores[0]
    finite = torch.isfinite(got)
    torch.testing.assert_close(got[finite], folded[finite], rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_patch_file_applies_and_undoes(model, tmp_path):
    patch = tmp_path / "p.py"
    patch.write_text(
        "def apply(model):\n"
        "    model._patched = True\n"
        "    def undo():\n"
        "        del model._patched\n"
        "    return undo\n"
    )
    with emulate(model, REFERENCE.with_(patch=patch)):
        assert model._patched
    assert not hasattr(model, "_patched")
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(BadInput, match="apply"), emulate(model, REFERENCE.with_(patch=bad)):
        pass


def test_bad_numerics_are_rejected():
    with pytest.raises(BadInput, match="fp8_e4m3"):
        Setting(index_k="fp8_e4m4")
    with pytest.raises(BadInput, match="score dtype"):
        Setting(score_dtype="fp16")
    with pytest.raises(BadInput, match="positive"):
        Setting(index_topk=0)


@torch.no_grad()
def test_exit_restores_a_scorer_override_installed_before_it(model):
    _, indexer = csa_indexers(model)[0]
    outer = indexer.scorer.forward  # the class's bound method

    def earlier(q, kv, h):
        return outer(q, kv, h)

    indexer.scorer.forward = earlier
    try:
        with emulate(model, Setting(index_k="fp8_e4m3", index_topk=3)):
            assert indexer.scorer.forward is not earlier
        assert indexer.scorer.__dict__["forward"] is earlier
    finally:
        del indexer.scorer.forward


def test_a_patch_file_executes_once_per_process_and_again_when_rewritten(model, tmp_path):
    runs = tmp_path / "runs"
    patch = tmp_path / "p.py"
    body = f"open({str(runs)!r}, 'a').write('x')\ndef apply(model):\n    return lambda: None\n"
    patch.write_text(body)
    for _ in range(3):
        with emulate(model, REFERENCE.with_(patch=patch)):
            pass
    assert runs.read_text() == "x"
    patch.write_text(body + "# changed\n")
    with emulate(model, REFERENCE.with_(patch=patch)):
        pass
    assert runs.read_text() == "xx"
