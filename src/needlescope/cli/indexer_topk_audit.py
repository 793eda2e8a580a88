"""``needlescope indexer topk-audit CAPTURE``: replay captured indexer logits through the exact top-k.

Exit status (docs/exit_codes.md): 0 when every row's selection is exact, 1 when any row is
inexact (a row with nothing to audit or NaN logits never is), 2 on bad input (one line). Formats
and definitions: docs/topk_audit.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from needlescope.cli.indexer import indexer_app
from needlescope.cli.output import console
from needlescope.cli.outputs import FORCE, guard
from needlescope.errors import BadInput
from needlescope.paths import check_out_dir

_CAPTURE_HELP = (
    "A safetensors file with 'logits' [R, L] or [R, layers, L] (-inf = padding), 'indices' (or 'topk_indices') "
    "and optional 'lengths' (or 'seq_lens') and 'positions'; or the JSON /generate response of needlescope serve "
    "sent with return_indexer_topk and return_indexer_logits."
)


@indexer_app.command("topk-audit")
def topk_audit_command(
    capture: Path = typer.Argument(..., help=_CAPTURE_HELP),
    indices: Path = typer.Option(
        None,
        "--indices",
        help="An engine's response JSON holding the selections (SGLang: meta_info.indexer_topk; vLLM PR "
        "#49555: choices[0].indexer_topk) for a CAPTURE of [R, layers, L] logits without indices.",
    ),
    layer: int = typer.Option(
        None, "--layer", help="Audit only this capture layer (index along the layers axis)."
    ),
    bin_bits: int = typer.Option(
        11, "--bin-bits", help="Bits of the float32 key that form the cut-off bin reported per row (1-32)."
    ),
    worst: int = typer.Option(10, "--worst", help="Inexact rows listed, lowest recall first."),
    out: Path = typer.Option(
        Path("topk-audit"), "--out", help="Output directory (topk_audit.json, topk_audit.md)."
    ),
    force: bool = FORCE,
) -> None:
    """Replay the logits through the exact top-k and report each row's recall, wrong keeps and drops."""
    from needlescope.dsa.topk_audit import audit_rows
    from needlescope.dsa.topk_audit_input import load_capture
    from needlescope.dsa.topk_audit_report import audit_report, render_audit_md, validate_audit, verdict_line

    if not 1 <= bin_bits <= 32:
        raise BadInput(f"--bin-bits must be in 1..32, got {bin_bits}")
    if worst < 0:
        raise BadInput(f"--worst must be >= 0, got {worst}")
    check_out_dir(out)
    with guard(out, "indexer topk-audit", force):
        data = load_capture(capture, indices_json=indices, layer=layer)
        columns = audit_rows(data.logits, data.selected, data.lengths, bin_bits=bin_bits)
        report = audit_report(data, columns, capture=str(capture), bin_bits=bin_bits, worst=worst)
        validate_audit(report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "topk_audit.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (out / "topk_audit.md").write_text(render_audit_md(report), encoding="utf-8")
    verdict = verdict_line(report)
    if report["exact"]:
        empty = report["rows_empty"]
        console.say(
            "[bold green]exact[/]: {} rows{}, every selection is the exact top-{}{}",
            report["rows"] - empty,
            " audited" if empty else "",
            report["k"],
            f"; {empty} rows had no candidate (nothing to audit, not called exact)" if empty else "",
        )
    else:
        recall = (
            ""
            if report["rows_inexact"] == 0
            else f"; selected-value recall min {report['recall_min']:.4f}, mean {report['recall_mean']:.4f}"
        )
        console.say("[bold red]flagged[/]: {}{}", verdict, recall, soft_wrap=True)
        for r in report["worst"]:
            where = f"row {r['row']}" + ("" if r["layer"] is None else f" layer {r['layer']}")
            where += "" if r["position"] is None else f" pos {r['position']}"
            if r["problem"] is not None:
                console.say("  {}: {}", where, r["problem"], soft_wrap=True)
                continue
            console.print(
                f"  {where}: recall {r['recall']:.4f}, overlap {r['overlap']:.4f}, {r['wrongly_kept']} kept "
                f"wrong, {r['wrongly_dropped']} dropped; {r['cutoff_bin_count']} candidates in the cut-off bin, "
                f"{r['ties_at_cutoff']} tied",
                soft_wrap=True,
            )
    console.print(f"wrote {out}/topk_audit.json, topk_audit.md", soft_wrap=True)
    if not report["exact"]:
        raise typer.Exit(1)
