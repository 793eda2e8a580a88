"""Fault: the indexer scores entry ``s`` with the key stored for entry ``s - 1``.

An off-by-one in the paged index-key cache (the page table's first slot reserved, the
kernel not told) shifts every key by one slot: the needle's key is scored at its
neighbour, so the top-k keeps the wrong entry while the attention gathers the right ones.

    needlescope serve --patch examples/patches/indexer_key_slot.py
"""

import torch

from needlescope.dsa.emulate import wrap_scorers


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            shifted = torch.cat([compressed_kv[:, :1], compressed_kv[:, :-1]], dim=1)
            return inner(q, shifted, hidden_states)

        return forward

    return wrap_scorers(model, wrap)
