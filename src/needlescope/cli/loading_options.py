"""The options that say where a checkpoint's weights go, for commands whose every forward runs
through ``dsa.passes`` (or layer-major), so that they can stream: ``indexer rank-dump``,
``indexer diff``, ``indexer compare-dump``, ``audit``.

They map one to one onto ``dsa.checkpoint.load_bundle(device=, max_memory=, stream_layers=)``;
those commands pass ``stream_if_needed=True``, so ``--device auto`` reads one decoder layer at a
time when the weights do not fit ``--max-memory`` (docs/scale.md). ``serve`` places but never
streams, and keeps its own wording.
"""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["Device", "MaxMemory", "StreamLayers"]

Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="cpu | cuda | cuda:N | auto (placed on every GPU, streamed when it does not fit) | cuda:0,cuda:1",
    ),
]
MaxMemory = Annotated[
    str | None,
    typer.Option("--max-memory", help="Weight bytes per device: 70GiB, or one per device (70GiB,60GiB)."),
]
StreamLayers = Annotated[
    bool,
    typer.Option(
        "--stream-layers", help="Read one decoder layer at a time per pass: weights larger than the device."
    ),
]
