"""``needlescope indexer diff | capture | synthetic``: localize, capture live, and simulate indexer numerics.

Torch-dependent modules are imported inside each command so ``needlescope --help`` stays fast.
Server and protocol failures of ``capture`` are reported like bad input: one line, exit 2.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console

from needlescope.cli.indexer import indexer_app
from needlescope.errors import BadInput, ProbeError
from needlescope.run.config import parse_float_list, parse_int_list

console = Console()

_PATCH_HELP = (
    "Python file defining apply(model) (may return an undo callable), or a built-in fault:NAME; "
    "applied to the candidate."
)


def _write(out: Path, name: str, text: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text, encoding="utf-8")
    return path


@indexer_app.command("diff")
def diff_command(
    model: str = typer.Option(..., "--model", help="Checkpoint directory or 'organism' (DeepSeek-V4)."),
    prompt: Path = typer.Option(..., "--prompt", help="Prompt file: plain text or a JSON messages list."),
    needle: str = typer.Option(..., "--needle", help="The needle's text, as it appears in the prompt."),
    out: Path = typer.Option(Path("diff-out"), "--out", help="Output directory (diff.json, diff.md)."),
    index_k: str = typer.Option("fp32", "--index-k", help="Candidate index-key precision."),
    index_q: str = typer.Option("fp32", "--index-q", help="Candidate index-query precision."),
    score_dtype: str = typer.Option(
        "fp32", "--score-dtype", help="Candidate score accumulation: fp32 | bf16."
    ),
    index_topk: int = typer.Option(
        None, "--index-topk", help="index_topk for both runs (default: the checkpoint's)."
    ),
    patch: Path = typer.Option(None, "--patch", help=_PATCH_HELP),
    growth: float = typer.Option(4.0, "--growth", help="Error growth a module may add per step (>= 1)."),
) -> None:
    """Run reference and candidate side by side and name the first module that diverges too much."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from needlescope.dsa.diff import diff_to_json, localize, render_diff_md
    from needlescope.dsa.emulate import REFERENCE, Numerics, load_patch
    from needlescope.dsa.prompt import needle_token_span, read_prompt_file, render_prompt
    from needlescope.organism.bundle import load_bundle, require_deepseek_v4, resolve_model_dir

    numerics = Numerics(index_k=index_k, index_q=index_q, score_dtype=score_dtype, index_topk=index_topk)
    if patch is not None:
        load_patch(patch)  # fail fast on a bad patch file, before loading the model
    if patch is None and Numerics(index_k=index_k, index_q=index_q, score_dtype=score_dtype) == REFERENCE:
        raise BadInput(
            "the candidate equals the reference; give candidate numerics (--index-k/--index-q/--score-dtype) "
            "or a --patch FILE"
        )
    if growth < 1:
        raise BadInput(f"--growth must be >= 1, got {growth}")
    path = resolve_model_dir(model)
    require_deepseek_v4(path)
    messages = read_prompt_file(prompt)
    # The needle is checked with the tokenizer alone, before the (slower) model loads.
    rendered = render_prompt(AutoTokenizer.from_pretrained(path, local_files_only=True), messages)
    span = needle_token_span(rendered, needle)
    hf_logging.disable_progress_bar()
    reference, tokenizer, _ = load_bundle(path)
    candidate, _, _ = load_bundle(path)
    if render_prompt(tokenizer, messages).input_ids != rendered.input_ids:
        raise BadInput(f"the tokenizer of {str(path)!r} renders the prompt differently when loaded twice")
    ids = torch.tensor([rendered.input_ids])
    result = localize(
        reference, candidate, ids, numerics=numerics, patch=patch, needle_span=span, growth=growth
    )
    _write(out, "diff.json", diff_to_json(result))
    _write(out, "diff.md", render_diff_md(result))
    first = result["first_divergent_module"]
    console.print(f"first divergent module: [bold]{first or 'none'}[/]")
    for r in result["layers"]:
        console.print(
            f"layer {r['layer']}: top-k overlap {r['topk_overlap']:.3f}, needle rank "
            f"{r['needle_rank_reference']} -> {r['needle_rank_candidate']}"
        )
    console.print(f"wrote {out}/diff.json, diff.md")


def _load_tokenizer(name: str):
    """(tokenizer, description, CSA layer ids or None) for 'organism' or a local checkpoint dir."""
    if name == "organism":
        from needlescope.organism.config import LAYER_TYPES
        from needlescope.organism.tokenizer import build_tokenizer

        ids = [i for i, t in enumerate(LAYER_TYPES) if t == "compressed_sparse_attention"]
        return build_tokenizer(), "organism", ids
    path = Path(name)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    if not path.is_dir() or not has_tokenizer:
        raise BadInput(f"--tokenizer {name!r} is not 'organism' or a directory holding a tokenizer")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.chat_template is None:
        raise BadInput(f"the tokenizer in {name!r} has no chat template; add one to tokenizer_config.json")
    layer_ids = None
    cfg_path = path / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        if isinstance(cfg.get("layer_types"), list):
            layer_ids = [i for i, t in enumerate(cfg["layer_types"]) if t == "compressed_sparse_attention"]
        elif isinstance(cfg.get("compress_ratios"), list):
            n = cfg.get("num_hidden_layers", len(cfg["compress_ratios"]))
            layer_ids = [i for i, r in enumerate(cfg["compress_ratios"][:n]) if r == 4]
    return tok, str(path), layer_ids


async def _capture(url: str, ids: list[int], max_new_tokens: int, timeout: float):
    from needlescope.targets.sglang import SGLangTarget

    async with SGLangTarget(url, timeout=timeout) as target:
        info = await target.server_info()
        gen = await target.generate(input_ids=ids, max_new_tokens=max_new_tokens)
    return info, gen


@indexer_app.command("capture")
def capture_command(
    sglang: str = typer.Option(..., "--sglang", help="SGLang server root URL, e.g. http://127.0.0.1:30000."),
    prompt: Path = typer.Option(..., "--prompt", help="Prompt file: plain text or a JSON messages list."),
    needle: str = typer.Option(..., "--needle", help="The needle's text, as it appears in the prompt."),
    out: Path = typer.Option(
        Path("capture-out"), "--out", help="Output directory (capture.json, capture.md)."
    ),
    tokenizer: str = typer.Option(
        "organism",
        "--tokenizer",
        help="'organism' or a local checkpoint dir: renders the chat template and finds the needle's tokens; "
        "the token ids are sent as input_ids so the server sees exactly these tokens.",
    ),
    index_topk: int = typer.Option(None, "--index-topk", help="Override the server's index_topk."),
    num_layers: int = typer.Option(None, "--num-layers", help="Override the number of indexer layers."),
    layer_ids: str = typer.Option(
        None,
        "--layer-ids",
        help="Model layer id of each capture layer, e.g. 2,4,6 (default: from the config).",
    ),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
    timeout: float = typer.Option(600.0, "--timeout", help="Request timeout in seconds."),
) -> None:
    """Ask a live SGLang server for its indexer top-k and report whether the needle was selected."""
    from needlescope.dsa.capture import (
        capture_report,
        decode_capture,
        default_answer_positions,
        render_capture_md,
    )
    from needlescope.dsa.prompt import covering_entries, needle_token_span, read_prompt_file, render_prompt
    from needlescope.targets.sglang import find_key

    if max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    for flag, v in (("--index-topk", index_topk), ("--num-layers", num_layers)):
        if v is not None and v < 1:
            raise BadInput(f"{flag} must be >= 1, got {v}")
    messages = read_prompt_file(prompt)
    tok, tok_desc, cfg_layer_ids = _load_tokenizer(tokenizer)
    rendered = render_prompt(tok, messages)
    span = needle_token_span(rendered, needle)
    entries = covering_entries(span, 4)
    try:
        info, gen = asyncio.run(_capture(sglang, rendered.input_ids, max_new_tokens, timeout))
        if gen.prompt_tokens != len(rendered.input_ids):
            raise BadInput(
                f"the server counted {gen.prompt_tokens} prompt tokens for the {len(rendered.input_ids)} input_ids "
                "sent; the capture rows would not line up with the needle's tokens"
            )
        rows = gen.prompt_tokens + gen.completion_tokens - 1
        k = index_topk if index_topk is not None else find_key(info, "index_topk")
        n = num_layers if num_layers is not None else find_key(info, "num_indexer_layers")
        topk = decode_capture(gen.indexer_topk, rows, num_layers=n, index_topk=k)
        n, k = int(topk.shape[1]), int(topk.shape[2])
        ids = list(parse_int_list(layer_ids, "--layer-ids")) if layer_ids is not None else None
        if ids is None:
            ids = cfg_layer_ids if cfg_layer_ids is not None and len(cfg_layer_ids) == n else list(range(n))
        if len(ids) != n:
            raise BadInput(f"--layer-ids names {len(ids)} layers but the capture has {n}")
        positions = default_answer_positions(gen.prompt_tokens, rows)
        layers = capture_report(topk, gen.prompt_tokens, entries, positions, ids)
    except ProbeError as exc:
        raise BadInput(f"{type(exc).__name__}: {exc}") from exc
    result = {
        "url": sglang,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "text": gen.text,
        "index_topk": k,
        "num_layers": n,
        "layer_ids": ids,
        "compress_ratio": 4,
        "needle_token_span": list(span),
        "needle_entries": entries,
        "answer_positions": positions,
        "layers": layers,
        "tokenizer": tok_desc,
    }
    _write(out, "capture.json", json.dumps(result, indent=2))
    _write(out, "capture.md", render_capture_md(result))
    for r in layers:
        first = r["selected_at_first_answer"]
        console.print(f"layer {r['layer']}: needle selected at first answer position: {first}")
    console.print(f"wrote {out}/capture.json, capture.md")


@indexer_app.command("synthetic")
def synthetic_command(
    entries: str = typer.Option("4096,65536", "--entries", help="Compressed-entry counts (up to 262144)."),
    heads: int = typer.Option(64, "--heads"),
    dim: int = typer.Option(128, "--dim"),
    queries: int = typer.Option(1, "--queries", help="Query rows per trial (they share the keys)."),
    topk: int = typer.Option(512, "--topk"),
    margins: str = typer.Option("0,0.01,0.05", "--margins", help="Needle margins, comma-separated."),
    margin_unit: str = typer.Option(
        "spread", "--margin-unit", help="abs (fp32 score units) | spread (fraction)."
    ),
    margin_ref: str = typer.Option("best", "--margin-ref", help="Margin over the best | kth distractor."),
    trials: int = typer.Option(20, "--trials"),
    precisions: str = typer.Option(
        "fp32,bf16,fp8_e4m3,fp4_e2m1",
        "--precisions",
        help="NAME (keys=queries) or K:Q[:ACC], comma-separated.",
    ),
    seed: int = typer.Option(0, "--seed"),
    chunk: int = typer.Option(16384, "--chunk", help="Entries scored per chunk (bounds memory)."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    kernel: str = typer.Option(
        "auto",
        "--kernel",
        help="Scoring: auto (Triton on CUDA for bf16/fp8 precisions) | reference | triton.",
    ),
    out: Path = typer.Option(Path("synthetic-out"), "--out", help="Output directory (synthetic.json, .md)."),
) -> None:
    """Plant a needle among random keys at real dimensions; measure how often each precision keeps it."""
    from needlescope.dsa.synthetic import (
        SyntheticConfig,
        parse_precisions,
        render_synthetic_md,
        run_synthetic,
    )
    from needlescope.kernels.scoring import kernel_backend

    cfg = SyntheticConfig(
        entries=parse_int_list(entries, "--entries"),
        heads=heads,
        dim=dim,
        queries=queries,
        topk=topk,
        margins=parse_float_list(margins, "--margins"),
        margin_unit=margin_unit,
        margin_ref=margin_ref,
        trials=trials,
        precisions=parse_precisions(precisions),
        seed=seed,
        chunk=chunk,
        device=device,
    )
    with kernel_backend(kernel, device):
        result = run_synthetic(cfg)
    _write(out, "synthetic.json", json.dumps(result, indent=2))
    md = render_synthetic_md(result)
    _write(out, "synthetic.md", md)
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out}/synthetic.json, synthetic.md")
