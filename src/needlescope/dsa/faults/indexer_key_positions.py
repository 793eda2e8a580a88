"""Fault: the indexer ropes its compressed keys at the entry index, not the token position.

A Triton indexer that computes key positions as ``i`` instead of ``i * compress_rate``
(the classic compressed-position slip) leaves the queries at token positions, so the
relative angle between a query and every compressed key is wrong by ``3 * i`` tokens.

    needlescope serve --patch examples/patches/indexer_key_positions.py
"""

from needlescope.dsa.emulate import csa_indexers


def apply(model):
    undo = []
    for _, indexer in csa_indexers(model):
        rotary = indexer.rotary_emb
        original = rotary.forward
        ratio, hidden = indexer.compress_rate, indexer.kv_proj.in_features

        def forward(x, position_ids, layer_type=None, _orig=original, _r=ratio, _h=hidden):
            # Compressed keys are [B, L, index_head_dim]; queries pass hidden_states [B, S, hidden].
            if x.shape[-1] != _h:
                position_ids = position_ids // _r
            return _orig(x, position_ids=position_ids, layer_type=layer_type)

        rotary.forward = forward
        undo.append(rotary)

    def restore():
        for rotary in undo:
            rotary.__dict__.pop("forward", None)

    return restore
