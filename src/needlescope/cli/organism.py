"""``needlescope organism train``: reproduce the shipped organism checkpoint, or train one stage.

With only ``--out`` (and optionally ``--seed``, ``--device``, ``--workers``) it runs the
shipped recipe (``needlescope.organism.recipe``): two stages and the bf16 cast, the final
checkpoint in ``--out`` and stage 1 in ``--out/stage1``. Any recipe flag instead trains one
stage: ``TrainConfig`` defaults plus the flags given.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import typer

from needlescope.cli.output import console, typer_app
from needlescope.cli.outputs import FORCE, guard

organism_app = typer_app(no_args_is_help=True, help="The model organism: a tiny trained DeepSeek-V4.")


# The options that are not recipe knobs; every other option of ``train`` is a TrainConfig field.
_RUN_OPTIONS = ("out", "seed", "device", "workers", "force")


@organism_app.command("train")
def train_command(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory for the checkpoint and training.json."),
    seed: int = typer.Option(0, help="Seed for weights and data."),
    steps_dense: int = typer.Option(None, help="Dense steps (any recipe flag trains one custom stage)."),
    steps_distil: int = typer.Option(None, help="Indexer-distillation steps."),
    steps_sparse: int = typer.Option(None, help="Sparse fine-tuning steps (0 skips the phase)."),
    sparse_topk: int = typer.Option(None, help="index_topk during sparse fine-tuning."),
    tokens_per_batch: int = typer.Option(None, help="Tokens per optimisation step."),
    max_minutes: float = typer.Option(None, help="Wall-clock cap; each phase gets a fixed share of it."),
    dense_stop: int = typer.Option(
        None, help="Stop the dense phase after this many steps of the --steps-dense schedule."
    ),
    lr: float = typer.Option(None, help="Peak learning rate of the dense phase."),
    init_from: Path = typer.Option(
        None, help="Continue training from this checkpoint directory ('organism': the shipped one)."
    ),
    config_override: list[str] = typer.Option(
        None,
        metavar="<key=int>",
        help="KEY=INT override of the organism config (repeatable), e.g. hidden_size=64.",
    ),
    wide_window: int = typer.Option(
        None, help="Curriculum: sliding window (tokens) for the first --wide-window-frac of dense steps."
    ),
    wide_window_frac: float = typer.Option(None, help="Fraction of dense steps run with --wide-window."),
    value_digits: int = typer.Option(
        None, help="Digits per needle value (probe with the same --value-digits)."
    ),
    value_digits_start: int = typer.Option(
        None, help="Curriculum: needle values start with this many digits and grow over the ramp."
    ),
    eval_every: int = typer.Option(None, help="Steps between held-out evaluations."),
    min_len: int = typer.Option(None, help="Shortest training example (tokens, approximate)."),
    max_len: int = typer.Option(None, help="Longest training example at the end of the length ramp."),
    ramp_frac: float = typer.Option(None, help="Fraction of dense steps over which the length cap rises."),
    kind_weights: str = typer.Option(
        None, help="Comma-separated weights of single,multikey,multivalue,multiturn,filler examples."
    ),
    device: str = typer.Option("cuda", help="torch device: cuda or cpu."),
    workers: int = typer.Option(None, help="Data-loader worker processes."),
    force: bool = FORCE,
) -> None:
    """Reproduce the shipped organism (only --out given), or train one custom stage."""
    from needlescope.devices import check_device
    from needlescope.errors import BadInput
    from needlescope.organism.train import TrainConfig, train

    check_device(device)
    overrides = _recipe_overrides(ctx.params)

    def show(entry: dict) -> None:
        console.print(json.dumps(entry), highlight=False, soft_wrap=True)

    # Like every command that writes a folder (cli.outputs): a checkpoint file in --out that this
    # command did not write (someone's config.json, a checkpoint's weights) is refused by name
    # before training starts; training wrote over them and found a file at --out only at its end.
    if not overrides:
        from needlescope.organism.recipe import recipe_configs, train_recipe

        with ExitStack() as folders:
            for target, _ in recipe_configs(out, seed=seed):  # OUT/stage1, then OUT
                folders.enter_context(guard(target, "organism train", force))
            done = train_recipe(out, seed=seed, device=device, workers=workers, on_log=show)
        for stage in done["stages"]:
            console.print(f"stage {stage['out']}: steps {stage['steps']}, {stage['wall_s']} s")
        console.print(f"shipped recipe, {done['wall_s']} s -> {out} (bf16)")
        return
    if workers is not None:
        overrides["workers"] = workers
    try:
        cfg = TrainConfig(seed=seed, **overrides)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc

    with guard(out, "organism train", force):
        record = train(cfg, out, device=device, on_log=show)
    console.print(f"steps {record['steps']}, {record['wall_s']} s -> {out}")


def _recipe_overrides(params: dict) -> dict:
    """TrainConfig fields from the recipe flags that were given (a flag not given is None)."""
    from needlescope.run.config import parse_float_list

    out = {}
    for name, value in params.items():
        if name in _RUN_OPTIONS or value is None:
            continue
        if name == "init_from":
            value = str(_checkpoint(value))
        elif name == "kind_weights":
            value = parse_float_list(value, "--kind-weights")
        elif name == "config_override":
            if not value:  # a repeatable option given no times
                continue
            name, value = "config_overrides", _overrides(value)
        out[name] = value
    return out


def _checkpoint(init_from: Path) -> Path:
    """--init-from as a DeepSeek-V4 checkpoint directory ('organism': the shipped one); BadInput
    otherwise, before anything loads (transformers took a missing path for a Hub repo id and
    failed with a traceback)."""
    from needlescope.dsa.checkpoint import require_deepseek_v4, resolve_model_dir
    from needlescope.errors import BadInput

    try:
        path = resolve_model_dir(init_from)
        require_deepseek_v4(path)
    except BadInput as exc:
        raise BadInput(f"--init-from: {exc}") from None
    return path


# Set from the tokenizer (organism.config.organism_config's own arguments), never by an override.
_FROM_TOKENIZER = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def _overrides(items: list[str]) -> dict[str, int]:
    """KEY=INT items as config fields. A key that is not an integer field of the organism's
    DeepSeek-V4 config is refused: the config keeps any keyword as an attribute, so a typo
    (hiden_size=64) trained the default model without a word."""
    import difflib

    from needlescope.errors import BadInput
    from needlescope.organism.config import organism_config

    config = organism_config(1, bos_token_id=0, eos_token_id=0, pad_token_id=0).to_dict()
    known = sorted(k for k, v in config.items() if type(v) is int and k not in _FROM_TOKENIZER)
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value.lstrip("-").isdigit():
            raise BadInput(f"--config-override must look like KEY=INT, got {item!r}")
        if key in _FROM_TOKENIZER:
            raise BadInput(f"--config-override {item!r}: {key} is set from the tokenizer; drop it")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the fields are {', '.join(known)}"
            raise BadInput(
                f"--config-override {item!r}: {key} is not an integer field of the organism's config; {hint}"
            )
        out[key] = int(value)
    return out
