"""Fault: the fp8 index keys are read back without their per-entry scale.

SGLang stores each index key as fp8 e4m3 plus one fp32 scale (amax / 448). A kernel that
multiplies by the stored fp8 values and forgets the scale scores entry ``s`` as
``q . K(k_s) / scale_s``: every entry is reweighted by ``448 / amax(k_s)``, so entries with
a small peak value outrank the needle. Run it with ``--index-k fp8_e4m3``.

    needlescope serve --index-k fp8_e4m3 --patch examples/patches/indexer_fp8_no_scale.py
"""

from needlescope.dsa.emulate import wrap_scorers

FP8_E4M3_MAX = 448.0


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            k = compressed_kv.float()
            scale = k.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_E4M3_MAX  # [B, L, 1]
            return inner(q, k / scale, hidden_states)

        return forward

    return wrap_scorers(model, wrap)
