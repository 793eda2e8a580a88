"""Planted (positional_bias, with undo): a recency term meant for another kernel is added to
the indexer scores, so the selection piles up at the end of the context."""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states)
            L = scores.shape[-1]
            ramp = torch.arange(L, device=scores.device, dtype=scores.dtype) / max(L - 1, 1)
            spread = scores.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
            return scores + 4.0 * spread * ramp

        return forward

    return wrap_scorers(model, wrap)
