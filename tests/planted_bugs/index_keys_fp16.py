"""Planted (benign, with undo): the indexer's compressed keys are stored in fp16; the ranking
moves by fp16 rounding only."""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            return inner(q, compressed_kv.to(torch.float16).float(), hidden_states)

        return forward

    return wrap_scorers(model, wrap)
