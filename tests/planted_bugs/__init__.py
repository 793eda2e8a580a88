"""The planted set of issue 37: file -> (planted class, returns an undo)."""

CLASSES = {
    "scorer_key_scale.py": ("ranking_uninformative", False),
    "topk_drops_best.py": ("needle_excluded", True),
    "key_cache_shift2.py": ("misaddressed", False),
    "recency_bias.py": ("positional_bias", True),
    "decode_sign_flip.py": ("decode_only", False),
    "hash_router_table.py": ("outside_selection", False),
    "boundary_residue.py": ("length_residue", False),
    "scorer_noise_graded.py": ("graded", True),
    "indexer_rope_mismatch.py": ("ranking_uninformative", False),
    "attn_out_bf16.py": ("none", False),
    "index_keys_fp16.py": ("none", True),
}

FAMILY = {name: "indexer scorer" for name, (cls, _) in CLASSES.items() if cls != "none"} | {
    "hash_router_table.py": "MoE router",
}
"""The module family each harmful bug lives in (the localizer's and ``where``'s answer)."""
