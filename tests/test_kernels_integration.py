"""needlescope.dsa scoring through the Triton kernels (interpreter on CPU): same ranks, same selections.

``kernel_backend`` / ``scores_backend`` swap ``lightning_scores`` for the kernels inside
``emulate`` (model path: rank dumps, sweeps, serve) and ``dsa.synthetic`` (random keys at real
dimensions). Here the kernels run under TRITON_INTERPRET=1 at small sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.emulate import IndexerCapture, emulate, scores_backend  # noqa: E402
from needlescope.dsa.synthetic import SyntheticConfig, parse_precisions, run_synthetic  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.kernels.scoring import kernel_backend, scores_factory  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402


def _strip(result: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "mean_margin_abs"} for r in result["results"]]


def test_synthetic_ranks_are_the_same_through_the_kernel() -> None:
    cfg = SyntheticConfig(
        entries=(300,),
        heads=4,
        dim=128,
        topk=16,
        trials=2,
        margins=(0.0,),
        precisions=parse_precisions("bf16,bf16:fp8_e4m3"),
        chunk=300,
    )
    ref = run_synthetic(cfg)
    with scores_backend(scores_factory("triton")):
        kern = run_synthetic(cfg)
    assert _strip(kern) == _strip(ref)


@torch.no_grad()
def test_model_indexer_scores_and_selections_match_through_the_kernel(tmp_path) -> None:
    path = save_random(tmp_path / "m", seed=0, hidden_size=64, moe_intermediate_size=64)
    model, _, _ = load_bundle(path)
    ids = torch.randint(10, 3000, (1, 96), generator=torch.Generator().manual_seed(1))
    numerics = Setting(index_k="fp8_e4m3", index_q="fp8_e4m3", index_topk=4)
    runs = []
    for factory in (None, scores_factory("triton")):
        cap = IndexerCapture(keep_scores=True)
        with scores_backend(factory), emulate(model, numerics, capture=cap) as layers:
            logits = model(ids).logits
        runs.append((logits, cap, layers))
    (ref_logits, ref_cap, layers), (k_logits, k_cap, _) = runs
    for layer in layers:
        _, ref_sel = ref_cap.rows(layer, width=4)
        _, k_sel = k_cap.rows(layer, width=4)
        assert torch.equal(ref_sel.sort(1).values, k_sel.sort(1).values)
        ref_s = torch.cat([s.flatten() for s in ref_cap.score_rows(layer)[1]])
        k_s = torch.cat([s.flatten() for s in k_cap.score_rows(layer)[1]])
        fin = torch.isfinite(ref_s)
        assert (k_s[fin] - ref_s[fin]).norm() / ref_s[fin].norm() < 1e-4
    assert torch.allclose(k_logits, ref_logits, rtol=1e-3, atol=1e-3)


def test_backend_choice_and_refusals() -> None:
    with pytest.raises(BadInput, match="reads keys and queries as"):
        scores_factory("triton")("fp32", "fp32")
    fallback = scores_factory("triton", strict=False)("fp4_e2m1", "fp32")
    assert fallback.__name__ == "lightning_scores"
    with pytest.raises(BadInput, match="accumulates in fp32"):
        scores_factory("triton")("bf16", "bf16")(
            torch.ones(1, 2, 128), torch.ones(3, 128), torch.ones(1, 2), scale=1.0, acc_dtype=torch.bfloat16
        )
    with kernel_backend("auto", "cpu"):  # off CUDA auto is the reference: nothing swapped
        from needlescope.dsa.emulate import scoring_function

        assert scoring_function("bf16", "bf16").__name__ == "lightning_scores"


def test_serve_with_the_triton_kernel_answers_like_the_reference(tmp_path) -> None:
    """Two real servers on loopback (official openai client): --kernel triton and --kernel reference."""
    import openai

    from needlescope.serve.launch import ServerProcess

    ckpt = save_random(
        tmp_path / "m", seed=1, hidden_size=64, moe_intermediate_size=64, max_position_embeddings=512
    )
    common = ["--model", str(ckpt), "--port", "0", "--index-k", "fp8_e4m3", "--index-q", "fp8_e4m3"]
    prompt = "the river ran past the old mill and the baker sold bread to every child in the town "
    answers = []
    for kernel in ("triton", "reference"):
        with (
            ServerProcess([*common, "--index-topk", "4", "--kernel", kernel]) as srv,
            openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as client,
        ):
            r = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=4,
                temperature=0,
            )
            answers.append((r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens))
    assert answers[0] == answers[1]
    assert answers[0][2] == 4


def test_serve_refuses_a_kernel_fault_without_the_triton_kernel() -> None:
    from needlescope.serve.config import ServeConfig

    with pytest.raises(BadInput, match="--kernel-fault needs --kernel triton"):
        ServeConfig(model="organism", kernel_fault="indexer_key_slot")
    with pytest.raises(BadInput, match="--kernel must be one of"):
        ServeConfig(model="organism", kernel="fast")
