"""Planted (positional_bias): a recency term meant for another kernel is added to the indexer's
scores, four times their spread at the newest entry, so the selection piles up at the end of the
context and a needle farther back than the top-k's reach is not selected."""

import torch
import transformers.models.deepseek_v4.modeling_deepseek_v4 as _modeling

_score = _modeling.DeepseekV4IndexerScorer.forward


def _forward(self, q, compressed_kv, hidden_states):
    scores = _score(self, q, compressed_kv, hidden_states)
    n = scores.shape[-1]
    ramp = torch.arange(n, device=scores.device, dtype=scores.dtype) / max(n - 1, 1)
    spread = scores.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
    return scores + 4.0 * spread * ramp


_modeling.DeepseekV4IndexerScorer.forward = _forward
