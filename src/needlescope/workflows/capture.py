"""The capture workflow: ask a live SGLang server for its indexer top-k and say whether the needle was selected.

``run(CaptureConfig(...)) -> dict`` renders the prompt with the checkpoint's chat template (the
token ids are sent as ``input_ids``, so the server sees exactly these tokens), generates with
``return_indexer_topk``, decodes the capture and builds ``capture.json`` (``CAPTURE_SCHEMA``);
``write(result, out)`` checks it against the schema and writes ``capture.json`` and ``capture.md``.
Server and protocol failures become ``BadInput`` (one line, exit 2 in the CLI).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from needlescope.errors import BadInput, ProbeError
from needlescope.paths import check_out_dir

__all__ = ["CaptureConfig", "load_capture_tokenizer", "run", "write"]

_CSA_RATIO = 4  # CSA layers compress 4 tokens per entry (the capture's entries are CSA entries)


@dataclass(frozen=True)
class CaptureConfig:
    """One live capture. ``None`` overrides mean: what the server reports / the config says."""

    url: str
    prompt: Path
    needle: str
    tokenizer: str = "organism"
    index_topk: int | None = None
    num_layers: int | None = None
    layer_ids: tuple[int, ...] | None = None
    max_new_tokens: int = 16
    timeout: float = 600.0
    api_key: str | None = field(default=None, repr=False)  # sent, never written

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        for flag, v in (("--index-topk", self.index_topk), ("--num-layers", self.num_layers)):
            if v is not None and v < 1:
                raise BadInput(f"{flag} must be >= 1, got {v}")
        if not self.timeout > 0:
            raise BadInput(f"--timeout must be > 0 seconds, got {self.timeout}")


def load_capture_tokenizer(name: str):
    """(tokenizer, description, CSA layer ids or None) for 'organism' or a local checkpoint dir."""
    from needlescope.dsa.checkpoint import csa_layer_ids, load_tokenizer, read_config

    if name == "organism":
        from needlescope.organism.config import LAYER_TYPES
        from needlescope.organism.tokenizer import build_tokenizer

        return build_tokenizer(), "organism", csa_layer_ids({"layer_types": list(LAYER_TYPES)})
    path = Path(name)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    if not path.is_dir() or not has_tokenizer:
        raise BadInput(f"--tokenizer {name!r} is not 'organism' or a directory holding a tokenizer")
    layer_ids = csa_layer_ids(read_config(path)) if (path / "config.json").is_file() else None
    return load_tokenizer(path), str(path), layer_ids


async def _generate(url: str, ids: list[int], max_new_tokens: int, timeout: float, api_key: str | None):
    from needlescope.targets.sglang import SGLangTarget

    async with SGLangTarget(url, timeout=timeout, api_key=api_key) as target:
        info = await target.server_info()
        gen = await target.generate(input_ids=ids, max_new_tokens=max_new_tokens)
    return info, gen


def run(cfg: CaptureConfig) -> dict:
    """Capture the server's indexer top-k for the prompt and report the needle's selection per layer."""
    from needlescope.dsa.capture import capture_report, decode_capture, default_answer_positions
    from needlescope.dsa.prompt import covering_entries, needle_token_span, read_prompt_file, render_prompt
    from needlescope.targets.sglang import find_key

    messages = read_prompt_file(cfg.prompt)
    tok, tok_desc, cfg_layer_ids = load_capture_tokenizer(cfg.tokenizer)
    rendered = render_prompt(tok, messages)
    span = needle_token_span(rendered, cfg.needle)
    entries = covering_entries(span, _CSA_RATIO)
    try:
        info, gen = asyncio.run(
            _generate(cfg.url, rendered.input_ids, cfg.max_new_tokens, cfg.timeout, cfg.api_key)
        )
        if gen.prompt_tokens != len(rendered.input_ids):
            raise BadInput(
                f"the server counted {gen.prompt_tokens} prompt tokens for the {len(rendered.input_ids)} "
                "input_ids sent; the capture rows would not line up with the needle's tokens"
            )
        rows = gen.prompt_tokens + gen.completion_tokens - 1
        k = cfg.index_topk if cfg.index_topk is not None else find_key(info, "index_topk")
        n = cfg.num_layers if cfg.num_layers is not None else find_key(info, "num_indexer_layers")
        topk = decode_capture(gen.indexer_topk, rows, num_layers=n, index_topk=k)
        n, k = int(topk.shape[1]), int(topk.shape[2])
        ids = list(cfg.layer_ids) if cfg.layer_ids is not None else None
        if ids is None:
            ids = cfg_layer_ids if cfg_layer_ids is not None and len(cfg_layer_ids) == n else list(range(n))
        if len(ids) != n:
            raise BadInput(f"--layer-ids names {len(ids)} layers but the capture has {n}")
        positions = default_answer_positions(gen.prompt_tokens, rows)
        layers = capture_report(topk, gen.prompt_tokens, entries, positions, ids)
    except ProbeError as exc:
        raise BadInput(f"{type(exc).__name__}: {exc}") from exc
    return {
        "url": cfg.url,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "text": gen.text,
        "index_topk": k,
        "num_layers": n,
        "layer_ids": ids,
        "compress_ratio": _CSA_RATIO,
        "needle_token_span": list(span),
        "needle_entries": entries,
        "answer_positions": positions,
        "layers": layers,
        "tokenizer": tok_desc,
    }


def write(result: dict, out: Path) -> list[str]:
    """Check ``result`` against CAPTURE_SCHEMA and write ``capture.json`` and ``capture.md``."""
    from needlescope.dsa.capture import render_capture_md, validate_capture

    validate_capture(result)
    check_out_dir(out).mkdir(parents=True, exist_ok=True)
    (out / "capture.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    (out / "capture.md").write_text(render_capture_md(result), encoding="utf-8")
    return ["capture.json", "capture.md"]
