"""Planted (graded ranking): the indexer scores with its first head only; the others' queries are
dropped (a head-loop bound off by a factor of the head count).

The ranking stays informative, only weaker: the needle falls below the cutoff more often as
the entries competing for ``index_topk`` multiply. Not a built-in fault: used by
``bench/investigate_planted_unknown.py`` and the investigation tests.
"""

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            one = q.clone()  # [B, S, H, D]
            one[:, :, 1:] = 0  # ReLU(0 . k) = 0: heads 1.. contribute nothing
            return inner(one, compressed_kv, hidden_states)

        return forward

    return wrap_scorers(model, wrap)
