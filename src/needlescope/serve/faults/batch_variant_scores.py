"""Fault: the indexer scorer's reduction depends on how many requests share the step.

A kernel that picks its configuration by the number of tokens in the batch (a split-K
reduction for large batches, a fast path for small ones) makes one request's indexer scores,
and so its top-k, depend on its batch mates. This one, whenever more than one request is
running at the step (the requests of every cohort of the continuous batch count, as one
forward of a paged engine would see them), splits the head sum of ``sum_h w_h ReLU(q_h . k)``
in two and accumulates only the first split (the second split's partial sums are dropped, as
a reduction that forgets its second pass), in bf16; alone it scores with the server's own
numerics. The same greedy request can answer differently at concurrency 32 than alone. It
costs recall only where the indexer drops entries (``--index-topk`` below the number of
compressed entries).

(Accumulating all heads in bf16 instead cost no recall on the organism, whose indexer margin
is wide: 15/15 at 1K, fp8 top-64, concurrency 8; docs/faults.md.)

    needlescope serve --index-topk 64 --patch fault:batch_variant_scores
"""

import torch

from needlescope.dsa.emulate import csa_indexers, wrap_scorers
from needlescope.dsa.reference import lightning_scores
from needlescope.serve.faults import patch_engine


def apply(model):
    running = {"n": 1}

    def model_call(original, engine, ids, start, cache, keep=1):
        running["n"] = max(ids.shape[0], len(engine._running))
        return original(engine, ids, start, cache, keep)

    scorers = iter([indexer.scorer for _, indexer in csa_indexers(model)])  # wrap_scorers' order

    def wrap(inner):
        scorer = next(scorers)

        def forward(q, compressed_kv, hidden_states):
            if running["n"] <= 1:
                return inner(q, compressed_kv, hidden_states)
            w = scorer.weights_proj(hidden_states).float()
            first = q.shape[2] // 2  # the first split of the heads
            return lightning_scores(
                q[:, :, :first].float(),
                compressed_kv.float(),
                w[:, :, :first],
                scale=scorer.softmax_scale,
                weight_scale=scorer.weights_scaling,
                acc_dtype=torch.bfloat16,
            ).float()

        return forward

    undo_engine = patch_engine(model, "_model_call", model_call)
    undo_scorers = wrap_scorers(model, wrap)

    def undo():
        undo_scorers()
        undo_engine()

    return undo
