"""Planted (decode path only): each decode step reads the indexer's key cache one slot off
(entry s scored with the key of entry s - 1); prefill is untouched and bit-identical.

A server runs decode in a different kernel (paged MQA logits) from prefill; a teacher-forced
forward never takes this path, so only a decode-path comparison can see it.
"""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            if q.shape[1] != 1:  # prefill (or a teacher-forced pass): the correct kernel
                return inner(q, compressed_kv, hidden_states)
            shifted = torch.cat([compressed_kv[:, :1], compressed_kv[:, :-1]], dim=1)
            return inner(q, shifted, hidden_states)

        return forward

    return wrap_scorers(model, wrap)
