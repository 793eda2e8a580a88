"""Ablation (not a bug): the indexer scores every entry with seeded uniform noise.

Recall under it shows how much the organism depends on the indexer finding the needle at
all: if it held, retrieval would not go through the top-k.
"""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    g = torch.Generator().manual_seed(0)

    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            s = inner(q, compressed_kv, hidden_states)  # [B, S, L]
            return torch.rand(s.shape, generator=g).to(s.device)

        return forward

    return wrap_scorers(model, wrap)
