"""The ``next`` command of a characterization: the experiment as a ``needlescope`` command the user
can run as printed (``characterize.characterize`` calls ``next_command``; pure: it reads the
``characterize.Context`` it is given (not imported: ``characterize`` imports this module), and
names only files the run wrote)."""

from __future__ import annotations

import shlex

__all__ = ["missing_experiments", "next_command"]


def _lengths(ctx, which: str) -> list[int]:
    base = max(ctx.lengths) if ctx.lengths else ctx.ratio * ctx.topk * 2
    if which == "dense":
        top = ctx.ratio * ctx.topk
        return sorted({max(ctx.ratio * 8, top // 2), top})
    return [base + d for d in range(1, ctx.ratio)]


def next_command(ctx, experiment: str) -> str:
    """The ``needlescope`` command that runs ``experiment`` against the candidate, runnable as
    printed: every file it names is one the run wrote (``Context``'s paths), and an experiment
    whose input the run could not write falls back to one it can run."""
    if experiment in ("dense", "residue") or (ctx.route == "live" and ctx.prompt is None):
        return _length_command(ctx, experiment if experiment in ("dense", "residue") else "residue")
    if ctx.route == "live":  # the selections on both paths: the live capture of a failing case
        return shlex.join(
            ["needlescope", "indexer", "capture", "--sglang", ctx.base_url or "", "--prompt", ctx.prompt]
            + ["--needle", ctx.needle or "", "--tokenizer", ctx.model, "--out", "next-capture"]
        )
    if ctx.input_ids is None:
        return _length_command(ctx, "residue")
    return shlex.join(
        ["needlescope", "indexer", "diff", "--model", ctx.model, "--input-ids", ctx.input_ids]
        + [*ctx.candidate_flags, "--index-topk", str(ctx.topk), "--device", ctx.device, "--out", "next-diff"]
    )


def _length_command(ctx, experiment: str) -> str:
    """Recall at the dense or residue lengths: ``probe`` against the live server, ``indexer
    sweep`` in-process (one patch at most: with more, the localizer's ``indexer diff``)."""
    lengths = ",".join(str(n) for n in _lengths(ctx, experiment))
    grid = ["--kind", "multiturn", "--lengths", lengths, "--depths", "0,50,100", "--trials", "4"]
    if ctx.route == "live":
        return shlex.join(
            ["needlescope", "probe", "--base-url", ctx.base_url or "", "--model", ctx.served_model]
            + [*grid, "--out", f"next-{experiment}"]
        )
    if ctx.sweep_flags is None and ctx.input_ids is not None:
        return next_command(ctx, "localize")
    return shlex.join(
        ["needlescope", "indexer", "sweep", "--model", ctx.model, *(ctx.sweep_flags or ())]
        + ["--index-topk", str(ctx.topk), *grid, "--device", ctx.device, "--out", f"next-{experiment}"]
    )


def missing_experiments(ev, ctx) -> list[tuple[str, str]]:
    """(experiment, what it would decide) for each discriminating measurement the ``characterize.Evidence``
    lacks, cheapest first (``undecided``'s list, and its first is ``next``)."""
    out = []
    if ev.not_reproduced:  # said first: what the selection classes would read is missing
        why = "answered otherwise when rerun alone: the failure depends on what ran before it (state kept"
        out.append(("localize", f"{ev.not_reproduced} failing case(s) {why} across requests, the batch)"))
    if not any(c.entries <= ctx.topk for c in ev.cells):
        out.append(("dense", "dense lengths (entries <= top-k) tell outside_selection from a selection bug"))
    if len({c.length % ctx.ratio for c in ev.cells if c.entries > ctx.topk}) < 2:
        out.append(("residue", f"lengths in other residue classes mod {ctx.ratio} test length_residue"))
    if not ev.layers:
        out.append(
            ("selection", "the failing cases' selections against the reference decide the selection classes")
        )
    elif len({s.path for s in ev.layers}) < 2:
        out.append(("paths", "prefill rows beside decode rows test decode_only"))
    if ctx.route == "in-process" and not ev.localized:
        out.append(("localize", "the localizer names the module family"))
    if not out:
        out.append(
            (
                "localize" if ctx.route == "in-process" else "paths",
                "no class's rule fires on these measurements; the selections of one failing case, module by module, may",
            )
        )
    return out
