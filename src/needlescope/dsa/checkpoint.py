"""Find and load DeepSeek-V4 (or any transformers) checkpoints: a standard HF directory.

A checkpoint directory holds ``config.json``, ``*.safetensors`` weights, the tokenizer files
(with a chat template) and optionally ``training.json`` (the organism's training record).
``"organism"`` names the checkpoint shipped in package data. Weights load through safetensors
only; nothing touches the network. Every way a directory can be unusable (missing, no
``config.json``, ``config.json`` that is not JSON, no or unreadable safetensors weights) is a
``BadInput`` with one line, raised before any model work.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from needlescope.cases.needles import VALUE_DIGITS
from needlescope.devices import check_device
from needlescope.errors import BadInput
from needlescope.paths import read_json_object

__all__ = [
    "ORGANISM",
    "shipped_dir",
    "quiet_transformers",
    "read_config",
    "resolve_model_dir",
    "check_weights",
    "context_tokens",
    "load_bundle",
    "load_tokenizer",
    "require_deepseek_v4",
    "csa_layer_ids",
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
    """The checkpoint shipped in package data (``needlescope/organism/weights``).

    Computed from the package layout rather than imported, so that ``dsa`` does not depend on
    ``organism`` (which sits beside it and imports it).
    """
    return Path(__file__).resolve().parent.parent / "organism" / "weights"


def read_config(path: Path) -> dict:
    """``path/config.json`` as a dict; BadInput when it is missing or not a JSON object."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise BadInput(f"{str(path)!r} has no config.json; it is not a transformers checkpoint directory")
    return read_json_object(cfg_path, "restore the checkpoint's config.json")


def context_tokens(path: Path) -> int | None:
    """The context in tokens that ``path/config.json`` states (``max_position_embeddings``);
    None when it states none (the tools then have nothing to check lengths against)."""
    context = read_config(path).get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
        return None
    return context


def check_weights(path: Path) -> None:
    """BadInput unless every ``*.safetensors`` file's header parses (a truncated or foreign file does not)."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error types and OSError
            raise BadInput(
                f"{str(f)!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                "re-copy or re-save the checkpoint"
            ) from None


def resolve_model_dir(name_or_dir: str | Path) -> Path:
    """``"organism"`` -> the shipped checkpoint; anything else must be a usable local checkpoint directory."""
    path = shipped_dir() if str(name_or_dir) == ORGANISM else Path(name_or_dir)
    if not path.is_dir():
        raise BadInput(
            f"model directory {str(path)!r} does not exist; give a local checkpoint directory or 'organism'"
        )
    read_config(path)
    if not any(path.glob("*.safetensors")):
        raise BadInput(
            f"{str(path)!r} has no *.safetensors weights; needlescope loads weights through safetensors only"
        )
    return path


def recorded_value_digits(path: Path) -> int | None:
    """Digits per needle value the checkpoint was trained on (its ``training.json``), if recorded."""
    record = path / "training.json"
    if not record.is_file():
        return None
    try:
        digits = json.loads(record.read_text()).get("config", {}).get("value_digits")
    except (json.JSONDecodeError, AttributeError):
        return None
    return digits if isinstance(digits, int) and not isinstance(digits, bool) else None


def trained_value_digits(path: Path) -> int:
    """Digits per needle value to probe ``path`` with: ``recorded_value_digits``, else the
    probe's default ``VALUE_DIGITS``.

    Probing an organism with longer values than it saw measures copying, not retrieval.
    """
    digits = recorded_value_digits(path)
    return VALUE_DIGITS if digits is None else digits


def require_deepseek_v4(path: Path) -> None:
    """BadInput unless the checkpoint at ``path`` is a DeepSeek-V4 model."""
    model_type = read_config(path).get("model_type")
    if model_type != "deepseek_v4":
        raise BadInput(
            f"{str(path)!r} is a {model_type!r} checkpoint; this command needs a DeepSeek-V4 (model_type "
            "'deepseek_v4') checkpoint such as 'organism'"
        )


def csa_layer_ids(config: dict) -> list[int] | None:
    """Model layer ids of the CSA (lightning-indexer) layers named by a checkpoint's ``config.json``:
    from ``layer_types`` (transformers) or ``compress_ratios`` (ratio 4, DeepSeek's own format);
    None when the config names neither."""
    if isinstance(config.get("layer_types"), list):
        return [i for i, t in enumerate(config["layer_types"]) if t == "compressed_sparse_attention"]
    if isinstance(config.get("compress_ratios"), list):
        n = config.get("num_hidden_layers", len(config["compress_ratios"]))
        return [i for i, r in enumerate(config["compress_ratios"][:n]) if r == 4]
    return None


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer; BadInput when it has no chat template (prompts are rendered with it)."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.chat_template is None:
        raise BadInput(
            f"{str(path)!r} has a tokenizer without a chat template; add one to tokenizer_config.json"
        )
    return tokenizer


def load_bundle(
    name_or_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    max_memory: str | None = None,
    reserve: int | None = None,
    stream_layers: bool = False,
    stream_if_needed: bool = False,
):
    """(model in eval mode, tokenizer, resolved path). Offline, safetensors only.

    ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` load the whole model there through
    ``from_pretrained`` (the organism's path, unchanged); ``"auto"`` (every visible GPU, else the
    CPU) or a comma-separated list (``"cuda:0,cuda:1"``) places decoder layers across the devices
    within ``max_memory`` (``"70GiB"`` or one size per device; default: each GPU's free memory
    minus ``reserve`` bytes), refusing before loading when the weights do not fit
    (``dsa.placement``, ``dsa.loading``). DeepSeek's release layout (``embed.weight``,
    ``layers.N.attn...``, block-fp8 ``.scale`` tensors) always loads that way, dequantized to bf16.
    ``dtype``: None is float32 for a transformers-layout checkpoint (as before) and the
    checkpoint's own dtype (bf16) for the release layout. ``dsa.loading.placement_of(model)`` gives the placement
    and the bytes per device.

    ``stream_layers``: keep the decoder layers on disk and read one at a time per pass
    (``dsa.streaming``), on the one device given (``auto``: the first GPU, else the CPU).
    ``stream_if_needed`` (for callers that run every forward through ``dsa.passes`` or
    ``dsa.diff``): with ``device="auto"`` streaming is also chosen when the weights do not fit
    the budgets; otherwise such a checkpoint is refused, as before.
    ``dsa.streaming.streamer_of(model)`` is then the layer reader with its per-layer times.

    Every DeepSeek-V4 model comes back with ``dsa.attention.blocked_attention`` (the eager
    math on the keys each block of queries may read: no ``T x T`` scores in a long forward) and
    ``dsa.full_selection`` (no indexer scores when its top-k selects every visible entry).
    """
    from needlescope.dsa.attention import use_blocked_attention
    from needlescope.dsa.full_selection import use_full_selection
    from needlescope.dsa.loading import checkpoint_tensors
    from needlescope.dsa.placement import DEFAULT_RESERVE, auto_devices
    from needlescope.dsa.release import is_release_layout
    from needlescope.dsa.streaming import load_weights

    for one in [] if device == "auto" else device.split(","):
        check_device(one.strip())
    path = resolve_model_dir(name_or_dir)
    check_weights(path)
    placed = device == "auto" or "," in device or max_memory is not None
    release = is_release_layout(checkpoint_tensors(path))
    if dtype is None and not release:
        dtype = torch.float32
    if placed or release or stream_layers:
        devices = auto_devices() if device == "auto" else [d.strip() for d in device.split(",") if d.strip()]
        if stream_layers and device == "auto":
            devices = devices[:1]
        with quiet_transformers():
            model = load_weights(
                path,
                devices=devices,
                max_memory=max_memory,
                reserve=DEFAULT_RESERVE if reserve is None else reserve,
                dtype=dtype,
                stream_layers=stream_layers,
                stream_if_needed=stream_if_needed and device == "auto",
            )
        return use_full_selection(use_blocked_attention(model)), load_tokenizer(path), path
    model = use_full_selection(use_blocked_attention(_from_pretrained(path, dtype)))
    tokenizer = load_tokenizer(path)
    return model.to(device).eval(), tokenizer, path


def _from_pretrained(path: Path, dtype: torch.dtype | None) -> torch.nn.Module:
    """The whole checkpoint through transformers' ``from_pretrained`` (the organism's path), on the CPU."""
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        raise BadInput(
            f"{str(path)!r} has safetensors shards but neither model.safetensors nor "
            "model.safetensors.index.json; restore the index that maps each tensor to its shard"
        )
    from needlescope.dsa.consistency import check_checkpoint
    from needlescope.dsa.loading import checkpoint_tensors

    # the placed and streamed loaders run the same check (dsa.loading.planned)
    check_checkpoint(path, checkpoint_tensors(path))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    # Eager attention: the V4 attention sinks and the compressor's block bias are only
    # implemented there, and it returns the attention probabilities the indexer distils from.
    # The loading info is checked here: transformers only logs a checkpoint that lacks tensors
    # (it initialises them at random) and raises a bare RuntimeError on a shape mismatch.
    with quiet_transformers(), _load_report_silenced():
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            use_safetensors=True,
            local_files_only=True,
            attn_implementation="eager",
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    _check_loading_info(path, info)
    return model


@contextmanager
def _load_report_silenced() -> Iterator[None]:
    """transformers' load report (a warning) off: ``_check_loading_info`` says it in one line."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _check_loading_info(path: Path, info: dict) -> None:
    """BadInput when the checkpoint lacks model tensors, holds others, or holds one of another shape
    (what the placed and streamed loaders refuse too)."""
    missing, unexpected = info.get("missing_keys") or [], info.get("unexpected_keys") or []
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        name, stored, wanted = next(iter(mismatched))
        raise BadInput(
            f"{path}: checkpoint tensor {name!r} has shape {tuple(stored)}, the model wants {tuple(wanted)} "
            f"({len(mismatched)} such tensor(s)); the weights do not match config.json"
        )
    if missing:
        raise BadInput(
            f"{path}: the checkpoint lacks {len(missing)} model tensors, e.g. {sorted(missing)[:3]}"
        )
    if unexpected:
        raise BadInput(
            f"{path}: {len(unexpected)} checkpoint tensors the model does not have, e.g. {sorted(unexpected)[:3]}"
        )
