"""What each command writes into its ``--out`` folder (``needlescope.outdir``), and its ``--force``.

A command wraps its writing in ``guard(out, SPEC, force)``: before anything runs, a file at one
of these names that the same command did not write (or that changed since) is refused in one
line; afterwards, what it wrote is recorded in the folder's manifest. ``--force`` overwrites.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, suppress
from pathlib import Path

import typer

from needlescope.cli.probe_options import API_KEY_ENV
from needlescope.errors import BadInput
from needlescope.outdir import OutputSpec, guarded_out, record_outputs
from needlescope.progress import Event

__all__ = ["FORCE", "OUTPUT_SPECS", "file_spec", "guard", "recording_runs"]

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
            # and B's store while it is built (run.compare_live renames it into place)
            state=(*(f"*/{name}" for name in _STORE), "b/results.sqlite.partial*"),
        ),
        OutputSpec("engine-state", (*_STORE, "engine_state.json", "engine_state.md"), state=_STORE),
        OutputSpec("serving-factors", ("serving_factors.json", "serving_factors.md")),
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
        # A checkpoint as save_pretrained writes it (model, tokenizer) and its training record.
        # Each folder a run writes is guarded on its own (the shipped recipe's stage1/ too): the
        # documented two-command recipe trains OUT/stage1, then OUT from it.
        OutputSpec(
            "organism train",
            (
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "model.safetensors.index.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "chat_template.jinja",
                "training.json",
            ),
        ),
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
                "serving_factors/",
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


API_KEY = typer.Option(
    None,
    "--api-key",
    envvar=API_KEY_ENV,
    show_default=False,
    help="Bearer key for the server (else NEEDLESCOPE_API_KEY or OPENAI_API_KEY); sent on every "
    "request, never written anywhere.",
)
"""The ``--api-key`` option of the commands that talk to an SGLang-style server (capture, a live
investigation); the probe family has its own (``probe_options``)."""


def guard(out: Path, command: str, force: bool) -> AbstractContextManager[None]:
    """``outdir.guarded_out`` with the command's spec."""
    return guarded_out(Path(out), OUTPUT_SPECS[command], force=force)


def file_spec(path: Path, command: str) -> tuple[Path, OutputSpec]:
    """(folder, spec) of a command whose ``--out`` names one file (``audit --out FILE``); a
    directory there is BadInput at once, before anything runs (the write would fail at the end)."""
    path = Path(path)
    if path.is_dir():
        raise BadInput(
            f"--out {str(path)!r} is a directory; pass a file path such as {str(path / 'out.json')!r}"
        )
    return path.parent, OutputSpec(command, (path.name,))


def recording_runs(on_event: Event, out: Path, command: str) -> Event:
    """``on_event``, and the folder's outputs recorded (``outdir.record_outputs``) each time a
    run begins or ends (``run_start``, ``run_end``). A command of several runs (compare's sides,
    the levels of ``--auto-difficulty``) writes each run's files long before it ends; recorded
    only at its end, a SIGKILL in a later run (or between two: compare setting up side B) left
    them unrecorded, and ``--resume`` refused them as foreign."""
    spec = OUTPUT_SPECS[command]

    def event(name: str, payload: dict) -> None:
        if name in ("run_start", "run_end"):
            with suppress(OSError):  # a full disk: the command's own error is the one to show
                record_outputs(Path(out), spec)
        on_event(name, payload)

    return event
