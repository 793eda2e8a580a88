"""Bugs planted in transformers' own DeepseekV4 code for ``transformers serve``: each file is a
``sitecustomize.py`` (copied under that name into a directory on the server's PYTHONPATH, so it
runs before the server loads anything). Each patches a class of
``transformers.models.deepseek_v4.modeling_deepseek_v4`` in place, with no undo, and nothing in
what the server reports says so. ``CLASSES``: file -> the class the black-box investigation must
name (``tests/test_transformers_serve_blackbox.py``)."""

CLASSES = {
    "hash_router_off_by_one.py": "outside_selection",
    "window_boundary_sign.py": "length_residue",
    "recency_ramp.py": "positional_bias",
    "decode_step_sign.py": "decode_only",
}
