"""Planted (RoPE-table mismatch in the indexer's own code, with undo): the indexer asks its rotary
for the main attention's table (rope_theta) when it rotates its queries, and for its own
compressed table (compress_rope_theta) for its keys. The rotary module computes faithfully
what it is asked; only the indexer's code, which names the table, is at fault. Issue 54 item 11:
the localizer said "first divergent module: none" while the top-k changed at most positions."""

import sys


def apply(model):
    swapped = []
    for _, idx in model.named_modules():
        if type(idx).__name__ != "DeepseekV4Indexer":
            continue
        base, keys_table = type(idx), idx.rope_layer_type
        query_table = next(t for t in idx.rotary_emb.layer_types if t != keys_table)

        class Mismatched(base):
            @property
            def rope_layer_type(self, keys_table=keys_table, query_table=query_table):
                # the queries' rotation is the one read after the compressed keys exist
                return query_table if "compressed_kv" in sys._getframe(1).f_locals else keys_table

        Mismatched.__name__ = Mismatched.__qualname__ = base.__name__
        idx.__class__ = Mismatched
        swapped.append((idx, base))

    def undo():
        for idx, base in swapped:
            idx.__class__ = base

    return undo
