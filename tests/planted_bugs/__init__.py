"""The planted set of issue 37: file -> (planted class, returns an undo).

The planted class is what the characterization must say: ``none`` for a bug that costs no recall
on the organism. ``indexer_rope_mismatch.py`` is a real bug that costs none here (only 16 of the
indexer's 128 dimensions are rotated; measured 1.00 vs 1.00 at 512 and 1,024 tokens, live): the
characterization must say "nothing to explain" / ``diverges_no_effect``, and the localizer must
still flag it (``FLAGGED``)."""

CLASSES = {
    "scorer_key_scale.py": ("ranking_uninformative", False),
    "topk_drops_best.py": ("needle_excluded", True),
    "key_cache_shift2.py": ("misaddressed", False),
    "recency_bias.py": ("positional_bias", True),
    "decode_sign_flip.py": ("decode_only", False),
    "hash_router_table.py": ("outside_selection", False),
    "boundary_residue.py": ("length_residue", False),
    "stale_far_keys.py": ("graded", False),
    "indexer_rope_mismatch.py": ("none", False),
    "attn_out_bf16.py": ("none", False),
    "index_keys_fp16.py": ("none", True),
}

FAMILY = {name: "indexer scorer" for name, (cls, _) in CLASSES.items() if cls != "none"} | {
    "hash_router_table.py": "MoE router",
}
"""The module family each harmful bug lives in (``where``'s answer in-process)."""

FLAGGED = FAMILY | {"indexer_rope_mismatch.py": "indexer scorer"}
"""The family the localizer must flag each bug in; a bug not here must not be flagged (bf16 or
fp16 rounding within its precision)."""

LOCALIZER_TOKENS = {"stale_far_keys.py": 4 * 168 + 1}
"""Prompt tokens (compression ratio 4) a bug needs in the localizer's test to change anything:
the window bug scrambles only entries more than its ``WINDOW`` (160) behind the query. The
others act within the test's default 69."""
