"""Planted (graded, with undo): the indexer's scores carry a rounding noise of a fixed share of
their spread (a reduced-precision accumulation): a partial loss of overlap that costs the needle
only where more entries compete."""

import torch

from needlescope.dsa.emulate import wrap_scorers

SHARE = 0.8


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states)
            g = torch.Generator().manual_seed(7)
            noise = torch.randn(scores.shape, generator=g).to(scores.device)
            return scores + SHARE * scores.std(dim=-1, keepdim=True).nan_to_num(0.0) * noise

        return forward

    return wrap_scorers(model, wrap)
