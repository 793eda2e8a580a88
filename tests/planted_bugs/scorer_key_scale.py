"""Planted (ranking_uninformative, no undo): every compressed entry is scored with the key
scale of another entry (a scale-table layout the reader disagrees on with the writer: a fixed
scramble of the slots), so the ranking carries almost nothing of the scores' order."""

import torch


def apply(model):
    for _, mod in model.named_modules():
        if type(mod).__name__ != "DeepseekV4IndexerScorer":
            continue
        inner = mod.forward

        def forward(q, compressed_kv, hidden_states, inner=inner):
            scores = inner(q, compressed_kv, hidden_states)
            g = torch.Generator().manual_seed(1234)
            scale = torch.exp(8.0 * torch.rand(scores.shape[-1], generator=g)).to(scores.device)
            return scores.clamp_min(0) * scale + scale * 1e-3

        mod.forward = forward
