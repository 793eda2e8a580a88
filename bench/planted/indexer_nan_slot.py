"""Planted (non-finite scores): the last entry of every 64-entry page of the indexer's score
buffer is never written (uninitialized memory, emulated as NaN). ``torch.topk`` ranks NaN
first, so those entries take top-k slots from real candidates.
"""

from needlescope.dsa.emulate import wrap_scorers

PAGE = 64


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states)  # [B, S, L]
            scores[..., PAGE - 1 :: PAGE] = float("nan")
            return scores

        return forward

    return wrap_scorers(model, wrap)
