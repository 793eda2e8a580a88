"""Planted (decode_only): the indexer's scores change sign on a one-token step (a decode kernel
that loads the head weights negated); the prefill is untouched. Deciding this class from outside
needs the answer teacher-forced, which ``transformers serve`` does not offer (no prompt logprobs,
no /tokenize): the black box must say so, not guess."""

import transformers.models.deepseek_v4.modeling_deepseek_v4 as _modeling

_score = _modeling.DeepseekV4IndexerScorer.forward


def _forward(self, q, compressed_kv, hidden_states):
    scores = _score(self, q, compressed_kv, hidden_states)
    return -scores if q.shape[1] == 1 else scores


_modeling.DeepseekV4IndexerScorer.forward = _forward
