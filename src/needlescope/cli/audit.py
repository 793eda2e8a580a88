"""``needlescope audit``: the built-in numerics checks on a checkpoint, one probe prompt.

Runs each named check (``needlescope.audit.checks``) on a multiturn probe case of
``--length`` tokens and prints every metric with its threshold; ``--out FILE`` writes them as
JSON (``[{"check", "metrics": [{"metric", "value", "threshold"}], "flagged", "why"}]``).
``--stream-layers``, or ``--device auto --max-memory`` below the weights, reads one decoder
layer at a time per pass (``cli.loading_options``, docs/scale.md).

Exit status: 0 when no check is flagged, 1 when any is (named on stderr, after the table and
``--out`` are written), 2 on bad input. Bad input is exit 2 before the checkpoint loads (an unknown or empty ``--checks``, a
``--length`` beyond the checkpoint's context) or, for the top-k checks, once it has loaded (a
``--length`` too short for the candidate's top-k to select anything).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from needlescope.cli import loading_options as load
from needlescope.cli.output import console
from needlescope.cli.outputs import FORCE, file_spec
from needlescope.outdir import check_outputs, record_outputs
from needlescope.paths import json_safe


def audit_command(
    model: str = typer.Option("organism", "--model", help="'organism' or a DeepSeek-V4 checkpoint dir."),
    checks: str = typer.Option(
        "hc_mix_bf16,routed_scale,decode_splitk_bf16,indexer_scores_bf16,index_keys_fp8",
        "--checks",
        help="Comma-separated built-in checks.",
    ),
    candidate: str = typer.Option(
        "k=fp8_e4m3 topk=64",
        "--candidate",
        help="The candidate Setting (its index_topk and patch are audited).",
    ),
    length: int = typer.Option(
        1024, "--length", help="Tokens of the probe prompt the activations come from."
    ),
    out: Path = typer.Option(None, "--out", help="Write the results as JSON here."),
    prefill_chunk: int = typer.Option(
        None,
        "--prefill-chunk",
        help="Run the prompt through the KV cache in chunks of this many tokens (docs/scale.md).",
    ),
    device: load.Device = "cpu",
    max_memory: load.MaxMemory = None,
    stream_layers: load.StreamLayers = False,
    force: bool = FORCE,
) -> None:
    """Op-level microtests and compounding of reduced-precision ops against the fp32 reference."""
    from needlescope.audit.checks import CHECKS
    from needlescope.errors import BadInput

    names = [c.strip() for c in checks.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHECKS or c == "index_topk"]
    offered = ", ".join(c for c in CHECKS if c != "index_topk")
    if unknown:
        raise BadInput(f"unknown check(s) {', '.join(unknown)}; choose from {offered}")
    if not names:  # an empty table and exit 0 read as a clean audit
        raise BadInput(f"--checks {checks!r} names no check; choose from {offered}")
    from needlescope.audit.run import audit_checkpoint
    from needlescope.cli.model_context import check_lengths
    from needlescope.setting import Setting

    # A prompt beyond the context was built and run anyway: transformers warned, then the
    # process was killed for memory (--length 100000 on the organism). The audit only prefills.
    check_lengths(model, [length], 0, "--length")
    if out is not None:
        check_outputs(*file_spec(out, "audit"), force=force)  # before the checkpoint loads
    results = audit_checkpoint(
        model,
        names,
        Setting.parse(candidate),
        length,
        chunk=prefill_chunk,
        device=device,
        max_memory=max_memory,
        stream_layers=stream_layers,
    )
    table = Table("check", "metric", "value", "threshold", "flagged")
    for r in results:
        for m in r["metrics"]:
            thr = "-" if m["threshold"] is None else f"{m['threshold']:g}"
            table.add_row(r["check"], m["metric"], f"{m['value']:.4g}", thr, "")
        table.add_row(r["check"], r["why"], "", "", Text("yes", style="bold red") if r["flagged"] else "no")
    console.print(table)
    if out is not None:
        # strict JSON: a non-finite metric (a checkpoint that makes NaN) is the string "nan"
        out.write_text(json.dumps(json_safe(results), indent=1), encoding="utf-8")
        record_outputs(*file_spec(out, "audit"))
        console.print(f"wrote {out}")
    flagged = [r["check"] for r in results if r["flagged"]]
    if flagged:  # a finding is exit 1, as with topk-audit and an inexact conform: scripts see it
        from needlescope.cli.output import err_console

        err_console.print(f"flagged: {', '.join(flagged)}", soft_wrap=True)
        raise typer.Exit(1)
