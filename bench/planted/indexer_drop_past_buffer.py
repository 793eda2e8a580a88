"""Planted (dropped candidates): the indexer keeps a candidate buffer of 128 entries and drops
every entry past it (scored -inf, never selected): a fixed-size workspace sized for 512 tokens.

Entries beyond the buffer are excluded whatever ``index_topk`` is, so a larger top-k does not
help: the needle is systematically excluded once it sits past token 512.
"""

from needlescope.dsa.emulate import wrap_scorers

BUFFER = 128


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states)  # [B, S, L]
            scores[..., BUFFER:] = float("-inf")
            return scores

        return forward

    return wrap_scorers(model, wrap)
