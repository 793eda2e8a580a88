"""What each command writes into its ``--out`` folder (``needlescope.outdir``), and its ``--force``.

A command wraps its writing in ``guard(out, SPEC, force)``: before anything runs, a file at one
of these names that the same command did not write (or that changed since) is refused in one
line; afterwards, what it wrote is recorded in the folder's manifest. ``--force`` overwrites.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import typer

from needlescope.outdir import OutputSpec, guarded_out

__all__ = ["FORCE", "OUTPUT_SPECS", "file_spec", "guard"]

FORCE = typer.Option(
    False, "--force", help="Overwrite files in --out that this command did not write (or that changed since)."
)

# A probe run: its store is checked by the probe itself (fingerprint, --resume), never by content.
_STORE = ("results.sqlite", "results.sqlite-wal", "results.sqlite-shm", "results.sqlite.lock")
_PROBE = (*_STORE, "summary.json", "report.md", "results.jsonl", "heatmap.png", "bundles/", "difficulty/")
_BISECT = ("bisect.json", "bisect.md")

OUTPUT_SPECS: dict[str, OutputSpec] = {
    spec.command: spec
    for spec in (
        OutputSpec("probe", (*_PROBE, *_BISECT), state=_STORE),
        OutputSpec(
            "compare",
            ("a/", "b/", "difficulty/", "compare.json", "report.md", "delta_heatmap.png", "pairs.jsonl"),
            state=tuple(f"*/{name}" for name in _STORE),
        ),
        OutputSpec("engine-state", (*_STORE, "engine_state.json", "engine_state.md"), state=_STORE),
        OutputSpec("oracle export", ("export.json",)),
        OutputSpec("oracle compare", ("candidate_export.json", "oracle.json", "oracle.md")),
        OutputSpec(
            "indexer rank-dump",
            ("rankdump.json", "stability.json", "rankdump.md", "rank_vs_layer.png", "margin_vs_length.png"),
        ),
        OutputSpec("indexer sweep", ("sweep.json", "sweep.md")),
        OutputSpec("indexer synthetic", ("synthetic.json", "synthetic.md")),
        OutputSpec("indexer diff", ("diff.json", "diff.md")),
        OutputSpec("indexer capture", ("capture.json", "capture.md")),
        OutputSpec("indexer compare-dump", ("compare_dump.json", "compare_dump.md")),
        OutputSpec("indexer topk-audit", ("topk_audit.json", "topk_audit.md")),
        OutputSpec(
            "investigate init",
            ("investigation.toml", "reference.env", "deployment.env", "patches/"),
        ),
        OutputSpec(
            "investigate run",
            (
                "state.json",
                "measure/",
                "localize/",
                "investigation.json",
                "verdicts.json",
                "DIAGNOSIS.md",
                "DIAGNOSIS.html",
                "recall.png",
                "rank_percentiles.png",
            ),
            # The run's own resumable state: it checks its ledger fingerprint itself.
            state=("state.json", "measure/*", "localize/*"),
        ),
    )
}


def guard(out: Path, command: str, force: bool) -> AbstractContextManager[None]:
    """``outdir.guarded_out`` with the command's spec."""
    return guarded_out(Path(out), OUTPUT_SPECS[command], force=force)


def file_spec(path: Path, command: str) -> tuple[Path, OutputSpec]:
    """(folder, spec) of a command whose ``--out`` names one file (``audit --out FILE``)."""
    path = Path(path)
    return path.parent, OutputSpec(command, (path.name,))
