"""Find, load and save organism-style checkpoints: a standard HF directory.

A bundle directory holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and optionally ``training.json``.
Weights load through safetensors only; nothing touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DeepseekV4ForCausalLM
from transformers.utils import logging as hf_logging

from needlescope.cases.needles import VALUE_DIGITS
from needlescope.errors import BadInput
from needlescope.organism.config import init_hash_routing, organism_config
from needlescope.organism.tokenizer import build_tokenizer

__all__ = [
    "ORGANISM",
    "shipped_dir",
    "resolve_model_dir",
    "load_bundle",
    "require_deepseek_v4",
    "save_random",
    "trained_value_digits",
]

ORGANISM = "organism"


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars inside the block: the library never prints."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def shipped_dir() -> Path:
    """The checkpoint shipped in package data (``needlescope/organism/weights``)."""
    return Path(str(resources.files("needlescope.organism") / "weights"))


def resolve_model_dir(name_or_dir: str | Path) -> Path:
    """``"organism"`` -> the shipped checkpoint; anything else must be a local checkpoint directory."""
    path = shipped_dir() if str(name_or_dir) == ORGANISM else Path(name_or_dir)
    if not path.is_dir():
        raise BadInput(
            f"model directory {str(path)!r} does not exist; give a local checkpoint directory or 'organism'"
        )
    if not (path / "config.json").is_file():
        raise BadInput(f"{str(path)!r} has no config.json; it is not a transformers checkpoint directory")
    if not any(path.glob("*.safetensors")):
        raise BadInput(
            f"{str(path)!r} has no *.safetensors weights; needlescope loads weights through safetensors only"
        )
    return path


def trained_value_digits(path: Path) -> int:
    """Digits per needle value to probe ``path`` with: those it was trained on (its
    ``training.json``), else the probe's default ``VALUE_DIGITS``.

    Probing an organism with longer values than it saw measures copying, not retrieval.
    """
    record = path / "training.json"
    if record.is_file():
        digits = json.loads(record.read_text()).get("config", {}).get("value_digits")
        if digits is not None:
            return digits
    return VALUE_DIGITS


def require_deepseek_v4(path: Path) -> None:
    """BadInput unless the checkpoint at ``path`` is a DeepSeek-V4 model."""
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type != "deepseek_v4":
        raise BadInput(
            f"{str(path)!r} is a {model_type!r} checkpoint; this command needs a DeepSeek-V4 (model_type "
            "'deepseek_v4') checkpoint such as 'organism'"
        )


def load_bundle(name_or_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model in eval mode, tokenizer, resolved path). Offline, safetensors only."""
    path = resolve_model_dir(name_or_dir)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    # Eager attention: the V4 attention sinks and the compressor's block bias are only
    # implemented there, and it returns the attention probabilities the indexer distils from.
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            use_safetensors=True,
            local_files_only=True,
            attn_implementation="eager",
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.chat_template is None:
        raise BadInput(
            f"{str(path)!r} has a tokenizer without a chat template; add one to tokenizer_config.json"
        )
    return model.to(device).eval(), tokenizer, path


def save_random(out: str | Path, *, seed: int = 0, **config_overrides) -> Path:
    """Save a randomly initialised organism-shaped checkpoint (tests; the start of training)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = organism_config(
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config)
    init_hash_routing(model, seed)
    with quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
