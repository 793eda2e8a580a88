"""Planted (graded, with undo): the indexer's scores carry an error of several times their spread
(a split-K reduction that races): a partial loss of overlap; the needle's outlying score survives
it while few entries compete and is lost where more do (measured with `indexer sweep`, fp8 keys,
top-64, three depths: answer recall 1.00 at 512 tokens, 0.67 at 1,024 and 2,048; at 0.8x the
spread, as first planted, the organism lost nothing up to 2,048 tokens)."""

import torch

from needlescope.dsa.emulate import wrap_scorers

SHARE = 4.0


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            scores = inner(q, compressed_kv, hidden_states)
            g = torch.Generator().manual_seed(7)
            noise = torch.randn(scores.shape, generator=g).to(scores.device)
            return scores + SHARE * scores.std(dim=-1, keepdim=True).nan_to_num(0.0) * noise

        return forward

    return wrap_scorers(model, wrap)
