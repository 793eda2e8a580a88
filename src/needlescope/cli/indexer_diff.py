"""``needlescope indexer diff``: differential localization (``capture`` lives in
``cli.indexer_capture``, ``synthetic`` in ``cli.indexer_sweep``).

Torch-dependent modules are imported inside the command so ``needlescope --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from needlescope.cli import loading_options as load
from needlescope.cli import setting_options as opt
from needlescope.cli.indexer import indexer_app
from needlescope.cli.model_context import check_lengths, check_topk
from needlescope.cli.output import console
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput
from needlescope.paths import check_out_dir
from needlescope.setting import REFERENCE, PatchRef


def _write(out: Path, name: str, text: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text, encoding="utf-8")
    return path


_INPUT_IDS_HELP = (
    "Instead of --prompt/--needle: a JSON file {'input_ids': [...], 'needle_token_span': [start, end]} "
    "(what 'investigate run' writes to localize/input_ids.json); the last id is the analysed query."
)


@indexer_app.command("diff")
def diff_command(
    model: str = typer.Option(..., "--model", help="Checkpoint directory or 'organism' (DeepSeek-V4)."),
    prompt: Path = typer.Option(None, "--prompt", help="Prompt file: plain text or a JSON messages list."),
    needle: str = typer.Option(None, "--needle", help="The needle's text, as it appears in the prompt."),
    input_ids: Path = typer.Option(None, "--input-ids", help=_INPUT_IDS_HELP),
    extra_patch: list[str] = typer.Option(
        None,
        "--extra-patch",
        metavar="<path>",
        help="A model-level patch file the candidate also carries (repeatable).",
    ),
    out: Path = typer.Option(Path("diff-out"), "--out", help="Output directory (diff.json, diff.md)."),
    index_k: opt.IndexK = None,
    index_q: opt.IndexQ = None,
    score_dtype: opt.ScoreDtype = None,
    index_topk: opt.IndexTopk = None,
    patch: opt.Patch = None,
    growth: float = typer.Option(
        None,
        "--growth",
        help="Fixed error growth per module (>= 1), overriding the calibrated budgets (default: calibrate).",
    ),
    allow: list[str] = typer.Option(
        None,
        "--allow",
        metavar="<pattern=dtype>",
        help="PATTERN=bf16|fp16: modules (fnmatch on the name) declared to run at a reduced precision; repeatable.",
    ),
    chunk: int = typer.Option(
        None,
        "--chunk",
        help="Run layer by layer in chunks of this many tokens through the KV cache (docs/scale.md).",
    ),
    device: load.Device = "cpu",
    max_memory: load.MaxMemory = None,
    stream_layers: load.StreamLayers = False,
    force: bool = FORCE,
) -> None:
    """Run reference and candidate side by side and name the first module that diverges too much."""
    import torch

    from needlescope.dsa.checkpoint import load_bundle, require_deepseek_v4, resolve_model_dir
    from needlescope.dsa.diff import diff_to_json, localize, parse_allow, render_diff_md, validate_diff
    from needlescope.dsa.passes import check_chunk
    from needlescope.dsa.prompt import read_prompt_file, render_prompt

    setting = opt.numerics_from_flags(index_k, index_q, score_dtype, index_topk)
    _check_candidate(setting, patch, extra_patch, growth)
    allowed = parse_allow(allow)
    path = resolve_model_dir(model)
    require_deepseek_v4(path)
    check_topk(path, [setting.index_topk])
    check_out_dir(out)
    with guard(out, "indexer diff", force):
        # The needle is checked with the tokenizer alone, before the (slower) model loads.
        token_ids, span = _diff_input(path, prompt, needle, input_ids)
        check_lengths(path, [len(token_ids)], 0, "the prompt's length")
        # Patches resolved last (never executed here); they run when the candidate is first patched.
        setting, extras = (
            opt.with_patch(setting, patch),
            tuple(PatchRef.resolve(p) for p in extra_patch or ()),
        )
        check_chunk(chunk)
        loading = dict(device=device, max_memory=max_memory, stream_layers=stream_layers)
        reference, tokenizer, _ = load_bundle(path, **loading, stream_if_needed=True)
        candidate, _, _ = load_bundle(path, **loading, stream_if_needed=True)
        if input_ids is None and render_prompt(tokenizer, read_prompt_file(prompt)).input_ids != token_ids:
            raise BadInput(f"the tokenizer of {str(path)!r} renders the prompt differently when loaded twice")
        ids = torch.tensor([token_ids])
        with ProgressView(console) as view:
            shown = lambda task, done, total, what: view(f"diff: {task}", done, total, what)  # noqa: E731
            result = localize(reference, candidate, ids, setting=setting, needle_span=span, growth=growth, allow=allowed, extra_patches=extras, progress=shown, chunk=chunk)  # fmt: skip
        validate_diff(result)
        _write(out, "diff.json", diff_to_json(result))
        _write(out, "diff.md", render_diff_md(result))
    _render_diff(result, out)
    if result["first_divergent_module"] is not None:
        raise typer.Exit(1)  # a finding (docs/exit_codes.md): a module diverges beyond its precision


def _check_candidate(setting, patch, extra_patch, growth) -> None:
    """BadInput when the candidate equals the reference or ``--growth`` is below 1."""
    if patch is None and not extra_patch and setting.with_(index_topk=None) == REFERENCE:
        raise BadInput(
            "the candidate equals the reference; give candidate numerics (--index-k/--index-q/--score-dtype) "
            "or a --patch FILE"
        )
    if growth is not None and growth < 1:
        raise BadInput(f"--growth must be >= 1, got {growth}")


def _render_diff(result: dict, out: Path) -> None:
    """The first divergent module, the modules worth naming, each CSA layer's selection."""
    from needlescope.dsa.diff_md import trivial_selection_note

    first = result["first_divergent_module"]
    # Module names hold "[call 2]": say() escapes them so rich markup cannot eat it.
    console.say("first divergent module: [bold]{}[/]", first or "none", soft_wrap=True)
    if first is None:
        console.print(result["summary"])
    for m in result["modules"]:
        if m["verdict"] in ("diverges", "reduced precision, within its rounding", "within precision"):
            console.print(f"  {m['module']}: {m['verdict']}", soft_wrap=True)
    for r in result["layers"]:
        console.print(
            f"layer {r['layer']}: top-k overlap {r['topk_overlap']:.3f} ({r['positions_changed']}/"
            f"{r['positions']} positions changed), needle rank "
            f"{r['needle_rank_reference']} -> {r['needle_rank_candidate']}"
            + ("" if r["rank_consistent"] else " (rank and selection disagree)")
        )
    trivial = trivial_selection_note(result)
    if trivial is not None:
        console.print(trivial, style="yellow", soft_wrap=True)
    console.print(f"wrote {out}/diff.json, diff.md")


def _diff_input(path: Path, prompt, needle, input_ids) -> tuple[list[int], tuple[int, int]]:
    """(token ids, needle token span) from --prompt/--needle or --input-ids; BadInput otherwise."""
    import json

    from needlescope.dsa.checkpoint import load_tokenizer
    from needlescope.dsa.prompt import needle_token_span, read_prompt_file, render_prompt

    if input_ids is not None:
        if prompt is not None or needle is not None:
            raise BadInput("give either --input-ids or --prompt with --needle, not both")
        try:
            obj = json.loads(Path(input_ids).read_text(encoding="utf-8"))
            ids, span = [int(i) for i in obj["input_ids"]], obj["needle_token_span"]
            a, b = int(span[0]), int(span[1])
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise BadInput(
                f"--input-ids {str(input_ids)!r}: expected a JSON object with 'input_ids' (a list of token ids) "
                f"and 'needle_token_span' ([start, end]); {type(exc).__name__}: {exc}"
            ) from None
        if not ids or not 0 <= a < b <= len(ids):
            raise BadInput(
                f"--input-ids {str(input_ids)!r}: the needle span {span} lies outside its {len(ids)} ids"
            )
        _check_vocab(path, ids, input_ids)
        return ids, (a, b)
    if prompt is None or needle is None:
        raise BadInput("give --prompt FILE and --needle TEXT (or --input-ids FILE)")
    rendered = render_prompt(load_tokenizer(path), read_prompt_file(prompt))
    return rendered.input_ids, needle_token_span(rendered, needle)


def _check_vocab(path: Path, ids: list[int], input_ids) -> None:
    """BadInput when a token id is outside the checkpoint's vocabulary (the embedding would raise)."""
    from needlescope.dsa.checkpoint import read_config

    vocab = read_config(path).get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        return
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise BadInput(
            f"--input-ids {str(input_ids)!r}: {len(bad)} token id(s) outside the checkpoint's vocabulary "
            f"0..{vocab - 1} (first: {bad[:5]}); write the ids with this checkpoint's tokenizer"
        )
