"""Planted (length_residue): when a prefill ends on a compression-window boundary (prompt length
= 0 mod the compression ratio), a window count that wraps flips the sign of the indexer's scale
for that prefill and every decode step after it, so top-k keeps the worst entries; every other
length is untouched (a boundary-arithmetic bug of the vllm#55927 kind)."""

import transformers.models.deepseek_v4.modeling_deepseek_v4 as _modeling

_index = _modeling.DeepseekV4Indexer.forward
_score = _modeling.DeepseekV4IndexerScorer.forward


def _indexer_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    if hidden_states.shape[1] > 1:  # a prefill decides for the decode steps that follow it
        self.scorer.wrapped = (int(position_ids[0, -1]) + 1) % self.compress_rate == 0
    return _index(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx)


def _scorer_forward(self, q, compressed_kv, hidden_states):
    scores = _score(self, q, compressed_kv, hidden_states)
    return -scores if getattr(self, "wrapped", False) else scores


_modeling.DeepseekV4Indexer.forward = _indexer_forward
_modeling.DeepseekV4IndexerScorer.forward = _scorer_forward
