"""Does a checkpoint's ``config.json`` describe the weights beside it? Checked before any model is built.

Every loader (transformers' ``from_pretrained``, the placed loader and the layer streamer) builds
its model from ``config.json`` and only then reads the weights. A config that names fewer layers
than the weights hold would run a smaller model (the streamer read only the layers it knew of);
one with ``num_hidden_layers`` -1 ends in a transformers traceback; one with ``hidden_size`` 1e6
or ``vocab_size`` 2e9 allocates many GiB before any tensor is compared. ``check_checkpoint`` is
the one check all loaders run first, on the raw JSON and the safetensors headers only:

- the size fields it names are positive integers;
- the decoder layers the tensor names hold are exactly ``0..num_hidden_layers-1``;
- a lower bound of the parameters the config implies (embedding, head, per-layer projections
  and routed experts; ``implied_parameters``) is at most ``SLACK`` times the elements stored.
  Every tensor the bound counts must be in the weights for the load to succeed, so a config
  that passes implies no more memory than the weights on disk (up to ``SLACK``).
"""

from __future__ import annotations

import re
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.paths import read_json_object

__all__ = [
    "SIZE_FIELDS",
    "SLACK",
    "check_checkpoint",
    "implied_parameters",
    "stored_elements",
    "stored_layers",
]

SIZE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "sliding_window",
    "max_position_embeddings",
)
"""Fields that size a tensor or a loop: when present, each must be a positive integer."""

SLACK = 2
"""How many times the stored elements the implied lower bound may reach (fp4 experts pack two
values a byte; a generous factor, since a real mismatch is off by orders of magnitude)."""

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _fix(path: Path) -> str:
    return f"restore the config.json saved with the weights in {str(path)!r}"


def _positive_ints(path: Path, config: dict) -> None:
    for field in SIZE_FIELDS:
        if field not in config or (field != "num_hidden_layers" and config[field] is None):
            continue
        value = config[field]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInput(
                f"{path}/config.json: {field} is {value!r}; it must be a positive integer; {_fix(path)}"
            )


def stored_layers(names) -> set[int]:
    """Decoder layer indices the tensor ``names`` hold (``model.layers.N.`` or the release's ``layers.N.``)."""
    return {int(m.group(1)) for m in map(_LAYER.match, names) if m}


def stored_elements(files: dict[str, Path]) -> int:
    """Values stored in the checkpoint, from the safetensors headers (no tensor is read); a
    one-byte integer tensor counts two (packed fp4)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    total = 0
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as handle:
            for name in names:
                part = handle.get_slice(name)
                n = 1
                for d in part.get_shape():
                    n *= d
                total += n * (2 if part.get_dtype() in ("I8", "U8") else 1)
    return total


def implied_parameters(config: dict) -> dict[str, int]:
    """A lower bound of the model's parameters by part, from ``config`` (its size fields checked positive).

    ``embedding``: vocab_size x hidden_size (and as much again for an untied head);
    ``attention``: per layer, the query projection's heads x head_dim x its input (q_lora_rank, else hidden_size);
    ``experts``: per layer, 3 x n_routed_experts x moe_intermediate_size x hidden_size;
    ``norms``: two hidden_size vectors per layer.
    """
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or max(1, hidden // heads)
    tied = config.get("tie_word_embeddings") is True
    experts = (config.get("n_routed_experts") or 0) * (config.get("moe_intermediate_size") or 0)
    return {
        "embedding": config["vocab_size"] * hidden * (1 if tied else 2),
        "attention": layers * heads * head_dim * (config.get("q_lora_rank") or hidden),
        "experts": layers * 3 * experts * hidden,
        "norms": layers * 2 * hidden,
    }


def check_checkpoint(path: Path, files: dict[str, Path]) -> None:
    """BadInput (one line: the field, the value, what to do) unless ``path/config.json`` describes
    the weights ``files`` (tensor name -> safetensors file). Reads the JSON and the headers only."""
    config = read_json_object(Path(path) / "config.json", "restore the checkpoint's config.json")
    for field in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if field not in config:
            raise BadInput(f"{path}/config.json has no {field}; {_fix(path)}")
    _positive_ints(path, config)
    n = config["num_hidden_layers"]
    held = stored_layers(files)
    if held and held != set(range(n)):
        span = f"layers 0..{max(held)}" if held == set(range(max(held) + 1)) else f"layers {sorted(held)}"
        missing = sorted(set(range(n)) - held)
        lacks = f"; the weights lack model.layers.{missing[0]}." if missing and max(held) >= n - 1 else ""
        raise BadInput(
            f"{path}/config.json says num_hidden_layers {n} but the weights hold {len(held)} decoder "
            f"layer(s) ({span}){lacks}; every loader would run a different model than the weights: {_fix(path)}"
        )
    parts = implied_parameters(config)
    implied, stored = sum(parts.values()), stored_elements(files)
    if implied > SLACK * stored:
        largest = max(parts, key=parts.__getitem__)
        raise BadInput(
            f"{path}/config.json implies at least {implied:,} parameters ({largest}: {parts[largest]:,}) but the "
            f"weights hold {stored:,} values; a size field (hidden_size {config['hidden_size']}, vocab_size "
            f"{config['vocab_size']}, num_hidden_layers {n}, ...) does not match the weights: {_fix(path)}"
        )
