"""Fault: the indexer reads its paged key cache by logical page, not through the block table.

SGLang keeps index keys in pages (64 tokens = 16 compressed entries here) that the allocator
hands out in any order. A kernel that indexes the cache by the logical page number instead of
``block_table[page]`` passes every single-request test, where the two coincide, and scores the
wrong keys once pages are scattered. The emulation pairs logical page ``p`` with physical page
``p ^ 1`` (neighbours swapped) while that page exists, so the needle's key is scored at the
entries of the page beside it: the needle's own entries rank like filler and fall below the
cutoff once ``index_topk`` no longer covers every entry.

    needlescope serve --index-k fp8_e4m3 --index-topk 64 --patch fault:indexer_page_table
"""

import torch

from needlescope.dsa.emulate import wrap_scorers

PAGE_ENTRIES = 16


def scrambled_slots(n_entries: int, page: int = PAGE_ENTRIES) -> torch.Tensor:
    """Long [n_entries]: the cache slot read for each entry: its twin in page ``p ^ 1`` while that slot exists."""
    slots = torch.arange(n_entries)
    swapped = slots ^ page  # flips the page's lowest bit for a power-of-two page size
    return torch.where(swapped < n_entries, swapped, slots)


def apply(model):
    def wrap(inner):
        def forward(q, compressed_kv, hidden_states):
            slots = scrambled_slots(compressed_kv.shape[1]).to(compressed_kv.device)
            return inner(q, compressed_kv[:, slots], hidden_states)

        return forward

    return wrap_scorers(model, wrap)
