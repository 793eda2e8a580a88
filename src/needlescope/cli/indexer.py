"""``needlescope indexer ...``: white-box commands on the sparse-attention indexer.

Commands live in ``indexer_rank`` (rank-dump), ``indexer_diff`` (diff), ``indexer_capture`` (capture) and
``indexer_sweep`` (sweep, synthetic); torch is imported inside each command so the CLI starts fast without it.
"""

from __future__ import annotations

from needlescope.cli.output import typer_app

indexer_app = typer_app(
    no_args_is_help=True, help="Look inside the lightning indexer: rank dumps, sweeps, diffs, live capture."
)
