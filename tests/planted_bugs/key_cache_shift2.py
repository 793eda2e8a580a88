"""Planted (misaddressed, no undo): the indexer reads its key cache two slots off: entry s is
scored with the key written for entry s - 2 (a writer/reader disagreement on the cache's
first slots)."""

import torch


def apply(model):
    for _, mod in model.named_modules():
        if type(mod).__name__ != "DeepseekV4IndexerScorer":
            continue
        inner = mod.forward

        def forward(q, compressed_kv, hidden_states, inner=inner):
            shifted = torch.cat([compressed_kv[:, :2], compressed_kv[:, :-2]], dim=1)
            return inner(q, shifted[:, : compressed_kv.shape[1]], hidden_states)

        mod.forward = forward
