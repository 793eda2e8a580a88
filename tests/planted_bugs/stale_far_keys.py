"""Planted (graded, no undo): the index-key cache keeps its newest ``WINDOW`` entries in order and
hands the older ones out of a pool whose slots are reused in a scrambled order (a free-list bug),
so an entry more than ``WINDOW`` entries behind the query is scored with another old entry's key.
The damage grows with the number of visible entries: at 512 tokens (128 entries, compression
ratio 4) nothing is old and nothing changes; at 1,024 the older ~100 of 256 entries are
scrambled, at 2,048 the older ~350 of 512. Within the window the scores are exact, and the
scrambled ones keep their values (only which entry carries which), so the selection's overlap
with the reference stays partial and its spread over the context is the reference's."""

import torch

WINDOW = 160
SEED = 37


def _scramble_old(scores: torch.Tensor, ratio: int) -> torch.Tensor:
    """scores [B,S,L] -> the same with each row's entries older than ``WINDOW`` permuted among
    themselves. Row s is the query ``S - 1 - s`` tokens before the last one, which sees the
    first ``L - ceil((S - 1 - s) / ratio)`` entries (exact for a prefill from position 0 and
    for a decode step, within one entry otherwise)."""
    S, L = scores.shape[-2:]
    dev = scores.device
    behind = torch.arange(S - 1, -1, -1, device=dev)
    old = (L - (behind + ratio - 1) // ratio - WINDOW).clamp_min(0)  # [S]: entries j < old[s] are old
    j = torch.arange(L, device=dev)
    g = torch.Generator().manual_seed(SEED)
    key = torch.rand(S, L, generator=g).to(dev)
    key = torch.where(j[None, :] < old[:, None], key, 1.0 + j[None, :].float())  # old first, in random order
    perm = key.argsort(dim=-1)  # [S,L]: position p < old[s] reads a random old entry, the rest p itself
    return scores.gather(-1, perm.expand_as(scores))


def apply(model):
    for _, idx in model.named_modules():
        if type(idx).__name__ != "DeepseekV4Indexer":
            continue
        inner = idx.scorer.forward

        def forward(q, compressed_kv, hidden_states, inner=inner, ratio=int(idx.compress_rate)):
            return _scramble_old(inner(q, compressed_kv, hidden_states), ratio)

        idx.scorer.forward = forward
