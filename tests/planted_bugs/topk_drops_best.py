"""Planted (needle_excluded, with undo): the top-k kernel drops its first bucket of candidates:
the four best-scoring entries of every query row are never selected (a radix-select
off-by-one), while the rest of the selection is the reference's."""

import torch

from needlescope.dsa.emulate import wrap_scorers

DROPPED = 4


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states)
            if scores.shape[-1] <= DROPPED:
                return scores
            best = scores.topk(DROPPED, dim=-1).indices
            return scores.scatter(-1, best, torch.finfo(scores.dtype).min)

        return forward

    return wrap_scorers(model, wrap)
