"""Planted (no recall effect expected): the indexer's head-weight projection reads its input
rounded to bf16 (a bf16 GEMM operand). It moves the scores by bf16 rounding, rarely the ranking.
"""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            return inner(q, compressed_kv, hidden_states.to(torch.bfloat16).to(hidden_states.dtype))

        return forward

    return wrap_scorers(model, wrap)
