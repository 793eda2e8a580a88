"""Planted (outside_selection): the hash-MoE router reads its token -> expert table one expert
off (an index conversion written into the lookup), in every hash-routed layer: a routing fault
upstream of every CSA indexer, so recall falls at every length, dense ones included."""

import transformers.models.deepseek_v4.modeling_deepseek_v4 as _modeling

_route = _modeling.DeepseekV4HashRouter.forward


def _forward(self, hidden_states, input_ids):
    logits, _, indices = _route(self, hidden_states, input_ids)
    indices = (indices + 1) % self.num_experts  # the table's expert ids read one off
    weights = self.score_fn(logits).gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, indices


_modeling.DeepseekV4HashRouter.forward = _forward
