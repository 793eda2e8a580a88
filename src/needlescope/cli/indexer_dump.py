"""``needlescope indexer compare-dump``: an engine's tensor dump against the reference model.

Inputs are checked (the dump's layout and names, the mapping, the prompt and needle) before the
checkpoint loads; every bad input is one line and exit code 2. A judge (docs/exit_codes.md): exit
0 when every tensor is within its budget, 1 when one is beyond it or could not be compared (the
verdict does not cover it), 2 on bad input.
"""

from __future__ import annotations

from pathlib import Path

import typer

from needlescope.cli import loading_options as load
from needlescope.cli.indexer import indexer_app
from needlescope.cli.output import console
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput
from needlescope.paths import check_out_dir


def _write(out: Path, name: str, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text, encoding="utf-8")


def _allow(specs, precisions) -> dict[str, str]:
    """``--allow NAME_PATTERN=PRECISION`` flags as a dict; BadInput on a malformed one."""
    allowed = {}
    for spec in specs or ():
        pattern, sep, prec = spec.partition("=")
        if not sep or not pattern or prec not in precisions:
            raise BadInput(
                f"--allow {spec!r} is not NAME_PATTERN=PRECISION; PRECISION is one of {', '.join(precisions)}"
            )
        allowed[pattern] = prec
    return allowed


@indexer_app.command("compare-dump")
def compare_dump_command(
    dump_dir: Path = typer.Argument(
        ..., help="The directory SGLang's dumper wrote (DUMPER_DIR or DUMPER_DIR/EXP)."
    ),
    model: str = typer.Option(
        ..., "--model", help="Reference checkpoint directory or 'organism' (DeepSeek-V4)."
    ),
    mapping: str = typer.Option(
        None,
        "--mapping",
        help="Mapping file (TOML) from engine names to reference modules (default: SGLang DeepSeek-V4).",
    ),
    prompt: Path = typer.Option(
        None, "--prompt", help="The prompt the engine ran on (needed when the dump carries no input_ids)."
    ),
    needle: str = typer.Option(None, "--needle", help="The needle's text in the prompt (needs --prompt)."),
    index_topk: int = typer.Option(
        None, "--index-topk", help="The engine's index_topk (default: the dump's top-k width)."
    ),
    growth: float = typer.Option(
        None, "--growth", help="Fixed error growth per tensor (>= 1) instead of calibrating."
    ),
    allow: list[str] = typer.Option(
        None,
        "--allow",
        metavar="<pattern=dtype>",
        help="NAME_PATTERN=bf16|fp16|fp8_e4m3|fp32: the precision engine tensors were computed in.",
    ),
    chunk: int = typer.Option(
        None,
        "--chunk",
        help="Run the reference layer by layer in chunks of this many tokens through the KV cache (docs/scale.md).",
    ),
    device: load.Device = "cpu",
    max_memory: load.MaxMemory = None,
    stream_layers: load.StreamLayers = False,
    out: Path = typer.Option(
        Path("compare-dump-out"), "--out", help="Output directory (compare_dump.json, .md)."
    ),
    force: bool = FORCE,
) -> None:
    """Merge a TP-sharded engine dump, run the reference on its tokens and name the first tensor beyond budget."""
    from needlescope.dsa.checkpoint import load_bundle, load_tokenizer, require_deepseek_v4, resolve_model_dir
    from needlescope.dsa.compare_dump import PRECISION_U, compare_dump
    from needlescope.dsa.compare_dump_md import (
        compare_dump_to_json,
        render_compare_dump_md,
        validate_compare_dump,
    )
    from needlescope.dsa.dump_mapping import load_mapping
    from needlescope.dsa.engine_dump import scan_dump
    from needlescope.dsa.prompt import needle_token_span, read_prompt_file, render_prompt
    from needlescope.setting import check_chunk

    allowed = _allow(allow, PRECISION_U)
    check_chunk(chunk)
    if needle is not None and prompt is None:
        raise BadInput("--needle needs the --prompt it appears in")
    path = resolve_model_dir(model)
    require_deepseek_v4(path)
    check_out_dir(out)
    with guard(out, "indexer compare-dump", force):
        the_mapping = load_mapping(mapping)
        scan_dump(dump_dir)  # the layout is checked before the model loads
        prompt_ids, span = None, None
        if prompt is not None:
            rendered = render_prompt(load_tokenizer(path), read_prompt_file(prompt))
            prompt_ids = rendered.input_ids
            span = needle_token_span(rendered, needle) if needle is not None else None
        loading = dict(device=device, max_memory=max_memory, stream_layers=stream_layers)
        reference, _, _ = load_bundle(path, **loading, stream_if_needed=True)
        with ProgressView(console) as view:
            shown = lambda task, done, total, what: view(f"compare-dump: {task}", done, total, what)  # noqa: E731
            result = compare_dump(reference, dump_dir, the_mapping, prompt_ids=prompt_ids, needle_span=span,
                                  index_topk=index_topk, growth=growth, allow=allowed, chunk=chunk, progress=shown)  # fmt: skip
        validate_compare_dump(result)
        _write(out, "compare_dump.json", compare_dump_to_json(result))
        _write(out, "compare_dump.md", render_compare_dump_md(result))
    _print_result(result, out)


def _print_result(result: dict, out: Path) -> None:
    """The summary, each layer and indexer, the files; exit 1 on a finding (docs/exit_codes.md)."""
    console.say("{}", result["summary"], soft_wrap=True)
    for d in result["layers"]:
        console.print(
            f"layer {d['layer'] if d['layer'] is not None else '-'}: {d['tensors']} tensors, "
            f"{d['beyond']} beyond budget, max rel_err {d['max_rel_err']:.3g}"
        )
    for r in result["indexer"]:
        console.print(f"layer {r['layer']} indexer: top-k overlap {r['topk_overlap']:.3f} "
                      f"({r['positions_changed']}/{r['positions']} positions changed)")  # fmt: skip
    if result["unknown_names"]:
        console.say("{} dumped name(s) not in the mapping, not compared: {}", len(result["unknown_names"]),
                    ", ".join(result["unknown_names"][:8]), soft_wrap=True)  # fmt: skip
    console.print(f"wrote {out}/compare_dump.json, compare_dump.md")
    if result["first_beyond"] is not None or any(t["verdict"] == "incomparable" for t in result["tensors"]):
        raise typer.Exit(1)  # a finding, as topk-audit's inexact row and conform's inexact case
