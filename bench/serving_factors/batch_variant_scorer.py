"""A batch-variant indexer scorer, to rehearse ``needlescope serving-factors`` on the organism.

Rows scored in a batch of more than one read the compressed keys in reverse order; a request
served alone is scored right. The stand-in for issue 52's planted batch-variant reduction until
``serve --patch fault:...`` ships one (docs/serving_factors.md):

    needlescope serve --model organism --index-topk 16 --patch bench/serving_factors/batch_variant_scorer.py
"""

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):  # q [B, S, H, D], compressed_kv [B, L, D]
            if q.shape[0] > 1:
                return inner(q, compressed_kv.flip(1), hidden_states)
            return inner(q, compressed_kv, hidden_states)

        return forward

    return wrap_scorers(model, wrap)
