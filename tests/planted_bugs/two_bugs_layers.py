"""Planted: two independent bugs at once (no undo), each in its own CSA layer and path (the
organism's CSA layers are 1 and 3):

* CSA layer 1's decode kernel flips the sign of the indexer's scores (``decode_sign_flip.py``
  restricted to one layer): its prefill agrees with the reference, its decode departs;
* CSA layer 3's prefill scores every entry with another entry's key scale
  (``scorer_key_scale.py`` restricted to one layer and the prefill): its prefill's ranking is at
  chance, its decode agrees.

The characterization must report both classes, each with its own ``where``
(``decide.characterize``'s two-site rule; ``tests/test_two_bugs_live.py``)."""

import re

import torch

DECODE_LAYER, PREFILL_LAYER = 1, 3


def _decode_flip(inner):
    def forward(q, compressed_kv, hidden_states):
        scores = inner(q, compressed_kv, hidden_states)
        return -scores if q.shape[1] == 1 else scores

    return forward


def _prefill_scale(inner):
    def forward(q, compressed_kv, hidden_states):
        scores = inner(q, compressed_kv, hidden_states)
        if q.shape[1] == 1:
            return scores
        g = torch.Generator().manual_seed(1234)
        scale = torch.exp(8.0 * torch.rand(scores.shape[-1], generator=g)).to(scores.device)
        return scores.clamp_min(0) * scale + scale * 1e-3

    return forward


def apply(model):
    for name, mod in model.named_modules():
        if type(mod).__name__ != "DeepseekV4IndexerScorer":
            continue
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        wrap = {DECODE_LAYER: _decode_flip, PREFILL_LAYER: _prefill_scale}.get(layer)
        if wrap is not None:
            mod.forward = wrap(mod.forward)
