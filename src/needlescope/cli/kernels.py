"""``needlescope kernels conform``: the adversarial top-k exactness suite against any implementation.

The library (``needlescope.kernels.conform``) builds the cases, runs each ``--impl`` and returns
the report; this prints one line per case and writes the JSON. Exit 0 when every case of every
implementation is exact and none wrote into its inputs, 1 otherwise (a finding), 2 on bad input
(one line; docs/exit_codes.md). Ctrl-C stops the run (exit 130, no report), even inside an
implementation. torch is imported inside the command so ``needlescope --help`` stays fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from needlescope.cli.interrupts import on_interrupt
from needlescope.cli.output import console, typer_app
from needlescope.cli.outputs import FORCE, file_spec
from needlescope.devices import check_device
from needlescope.outdir import check_outputs, record_outputs

kernels_app = typer_app(no_args_is_help=True, help="Check GPU kernels: the top-k conformance suite.")


def _line(impl: str, res) -> None:
    wrote = f"  WROTE INTO ITS INPUTS: {', '.join(res.inputs_written)}" if res.inputs_written else ""
    if res.error is not None:  # no answer to score: the error, never a recall of 0
        console.print(f"{res.name:<27} {'ERROR':<8} {res.error}{wrote}  [{impl}]", soft_wrap=True)
        return
    verdict = "exact" if res.exact else "INEXACT"
    console.print(
        f"{res.name:<27} {verdict:<8} recall {res.recall_min:.4f} min {res.recall_mean:.4f} mean"
        f"  rows wrong {res.rows_inexact:>2}/{res.rows:<2}  worst row {res.worst_row}:"
        f" {res.worst_missed} missed, {res.worst_wrong} wrong{wrote}  [{impl}]",
        soft_wrap=True,
    )


@kernels_app.command("conform")
def conform_command(
    impl: list[str] = typer.Option(
        ...,
        "--impl",
        metavar="<module:function>",
        help="MODULE:FUNCTION or PATH.py:FUNCTION of a callable (scores fp32 [R, W], k, lengths int32 [R]) "
        "-> int [R, k]; 'ours' (every method and dispatch path of needlescope's), 'ours:NAME', 'torch'. Repeatable.",
    ),
    shapes: str = typer.Option("small", "--shapes", help="small (CPU, interpreter) or full (GPU)."),
    device: str = typer.Option(
        None, "--device", help="Where the rows live (default: cuda when available, else cpu)."
    ),
    case: list[str] = typer.Option(
        None, "--case", metavar="<name>", help="Run only this case (repeatable; default: all)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated rows."),
    out: Path = typer.Option(None, "--out", help="Write the JSON report here (docs/conformance.md)."),
    force: bool = FORCE,
) -> None:
    """Run every case through every --impl: per case exact or not, selected-value recall and the
    worst row. On the CPU, Triton runs under its interpreter (TRITON_INTERPRET=1 is set here
    unless already set)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
    from needlescope.kernels.conform import conform, load_impl

    if out is not None:
        check_outputs(*file_spec(out, "kernels conform"), force=force)  # before any case runs
    impls = [pair for spec in impl for pair in load_impl(spec, device)]
    if "ours" in impl and device == "cpu":
        from needlescope.kernels.topk_impls import GPU_ONLY

        console.print(
            f"not run on the CPU (CUDA C++, no interpreter): {', '.join('ours:' + n for n in GPU_ONLY)}"
        )
    with on_interrupt(lambda: "no report was written", "rerun the command to run the cases again"):
        report = conform(impls, shapes=shapes, device=device, names=case or None, seed=seed, on_case=_line)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        record_outputs(*file_spec(out, "kernels conform"))
    failing = [r["impl"] for r in report["impls"] if not r["exact"] or r["wrote_inputs"]]
    for r in report["impls"]:
        bad = [c["name"] for c in r["cases"] if not c["exact"] and c["error"] is None]
        errors = [c["name"] for c in r["cases"] if c["error"] is not None]
        parts = [f"{len(bad)} inexact: {', '.join(bad)}"] if bad else []
        parts += [f"{len(errors)} errors (no answer to score): {', '.join(errors)}"] if errors else []
        if r["wrote_inputs"]:
            parts.append(f"wrote into its inputs in {len(r['wrote_inputs'])}: {', '.join(r['wrote_inputs'])}")
        summary = "; ".join(parts) or "every case exact"
        console.print(f"{r['impl']}: {len(r['cases'])} cases, {summary}", soft_wrap=True)
    if failing:
        raise typer.Exit(1)
