"""Planted (decode_only, no undo): the decode kernel flips the sign of the indexer's scores
(its head weights loaded negated); prefill is untouched."""


def apply(model):
    for _, mod in model.named_modules():
        if type(mod).__name__ != "DeepseekV4IndexerScorer":
            continue
        inner = mod.forward

        def forward(q, compressed_kv, hidden_states, inner=inner):
            scores = inner(q, compressed_kv, hidden_states)
            return -scores if q.shape[1] == 1 else scores

        mod.forward = forward
