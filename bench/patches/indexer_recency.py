"""Ablation (not a bug): the indexer keeps the most recent ``index_topk`` entries, whatever their content.

With it, what a CSA layer can read is only the last ``4 * index_topk`` tokens plus the sliding
window: the recall curve it gives is the floor that content-based selection must beat.
"""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            s = inner(q, compressed_kv, hidden_states)  # [B, S, L]
            return torch.arange(s.shape[-1], device=s.device, dtype=s.dtype).expand_as(s).clone()

        return forward

    return wrap_scorers(model, wrap)
