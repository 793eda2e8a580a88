"""Planted (RoPE-table mismatch inside the indexer, no undo): the indexer's queries are rotated
with the main attention's table (rope_theta) while its keys keep the compressed table
(compress_rope_theta): q . k carries a position-dependent skew (ik_llama.cpp PR #2099)."""


def apply(model):
    for _, idx in model.named_modules():
        if type(idx).__name__ != "DeepseekV4Indexer":
            continue
        rope, head_dim = idx.rotary_emb, idx.head_dim
        other = next(t for t in rope.layer_types if t != idx.rope_layer_type)
        inner = rope.forward

        def forward(x, position_ids, layer_type=None, inner=inner, other=other, head_dim=head_dim):
            # the keys' call passes the compressed keys (index_head_dim); the queries' the hidden states
            return inner(x, position_ids, layer_type=other if x.shape[-1] != head_dim else layer_type)

        rope.forward = forward
