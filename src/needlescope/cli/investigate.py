"""``needlescope investigate init|run``: the investigation ledger and its run.

``init [DIR]`` writes the commented example ledger (the original DeepSeek-V4-Flash
investigation replayed on the organism) with its env file and patch files. ``run LEDGER --out
DIR`` runs it (resumable: run it again after Ctrl-C or a crash), with a progress bar per
phase, and writes ``verdicts.json``, ``DIAGNOSIS.md`` and ``DIAGNOSIS.html`` into DIR.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from needlescope.cli.interrupts import measured_saved, on_interrupt
from needlescope.cli.output import clip, console, typer_app
from needlescope.cli.outputs import API_KEY, FORCE, guard

if TYPE_CHECKING:
    from needlescope.investigate.decide.findings import Findings

investigate_app = typer_app(no_args_is_help=True, help="From measurements to a causal verdict.")


@investigate_app.command("init")
def init_command(
    directory: Path = typer.Argument(Path("."), help="Where to write investigation.toml and its files."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files (ours or not)."),
    live: str = typer.Option(
        None,
        "--live",
        help="Write a live ledger for this endpoint (a server answering /generate with captures).",
    ),
    from_probe: Path = typer.Option(
        None, "--from-probe", help="Write a live ledger whose symptom is this probe run's failing cells."
    ),
    config: Path = typer.Option(
        None,
        "--config",
        help="With --live and an endpoint without a capture: the served checkpoint's config.json "
        "(compression ratio, index_topk), copied beside the ledger.",
    ),
    topk_endpoint: str = typer.Option(
        None,
        "--topk-endpoint",
        metavar="URL",
        help="With --live and an endpoint without a capture: a second server of the same deployment "
        "with a larger --index-topk (the top-k pair experiment).",
    ),
    served_model: str = typer.Option(
        None,
        "--served-model",
        metavar="ID",
        help="With --live and an endpoint without a capture: the model id its chats send "
        "(needed where /v1/models lists none, e.g. transformers serve: its model path).",
    ),
    api_key: str = API_KEY,
) -> None:
    """Write a ledger: the example (the original investigation, on the organism), a live one."""
    from needlescope.errors import BadInput
    from needlescope.investigate.ledger.example import EXAMPLE_FILES, write_example
    from needlescope.investigate.ledger.init import from_probe_ledger, live_ledger, write_ledger
    from needlescope.investigate.ledger.ledger import parse_ledger

    if live is not None and from_probe is not None:
        raise BadInput("give --live URL or --from-probe RUN_DIR, not both")
    if topk_endpoint is not None and live is None:
        raise BadInput("--topk-endpoint goes with --live URL (the endpoint whose top-k it enlarges)")
    if served_model is not None and live is None:
        raise BadInput("--served-model goes with --live URL (an endpoint without a capture); drop it")
    if config is not None and not config.is_file():
        raise BadInput(f"--config {config} is no file; pass the served checkpoint's config.json")
    with guard(directory, "investigate init", force):
        if live is None and from_probe is None:
            path = write_example(directory, force=force)
            for name in EXAMPLE_FILES:
                console.print(f"wrote {Path(directory) / name}")
        else:
            named = None if config is None else "config.json"
            text = (
                live_ledger(
                    live,
                    api_key=api_key,
                    config=named,
                    topk_endpoint=topk_endpoint,
                    served_model=served_model,
                )
                if live is not None
                else from_probe_ledger(from_probe, api_key=api_key)
            )
            parse_ledger(text, Path(directory) / "investigation.toml")  # a ledger that would not run is a bug
            path = write_ledger(directory, text, force=force)
            if config is not None and 'candidate = "blackbox"' in text:
                copied = Path(directory) / "config.json"
                if config.resolve() != copied.resolve():
                    copied.write_bytes(config.read_bytes())
                console.print(f"wrote {copied}")
            console.print(f"wrote {path}")
    # The run writes beside its ledger, as `make demo` runs it (tests/test_cli_piped_output.py
    # holds the two to the same command).
    console.print(f"next: needlescope investigate run {path} --out {directory}", soft_wrap=True)


def run_investigation_cli(
    ledger,
    out: Path,
    allow_outside: bool = False,
    prefill_chunk: int | None = None,
    api_key: str | None = None,
    serving_factors: bool = False,
    max_memory: str | None = None,
    device: str = "cpu",
) -> tuple[Findings, Path]:
    """Run ``ledger`` (its path, or the ``Ledger`` parsed from it) with progress per phase
    (``cli.progress``) and render the reports from the returned ``Findings``; returns them and
    DIAGNOSIS.md's path. ``max_memory`` bounds the run on ``device`` (``dsa.budget.bounded_memory``)."""
    from needlescope.cli.progress import ProgressView
    from needlescope.dsa.budget import bounded_memory
    from needlescope.investigate.report.diagnosis import write_reports
    from needlescope.investigate.run import run_investigation

    with bounded_memory(max_memory, device), ProgressView(console) as view:
        findings = run_investigation(
            ledger,
            out,
            lambda phase, done, total, what="": view(phase, done, total, clip(what, 60)),
            allow_outside=allow_outside,
            prefill_chunk=prefill_chunk,
            api_key=api_key,
            serving_factors=serving_factors,
        )
    md, _ = write_reports(findings, command=shlex.join(["needlescope", *sys.argv[1:]]))
    return findings, md


def _check_ledger_fits(ledger: Path, allow_outside: bool):
    """The parsed ledger; BadInput, before any model loads, for symptom lengths beyond the
    checkpoint's context or an index_topk no context holds (``cli.model_context``)."""
    from needlescope.cli.model_context import check_lengths, check_topk
    from needlescope.investigate.ledger.ledger import load_ledger

    parsed = load_ledger(ledger, allow_outside=allow_outside)
    target, symptom = parsed.target, parsed.symptom
    check_lengths(target.model, symptom.lengths, symptom.max_new_tokens, f"{ledger}: [symptom] lengths")
    settings = (target.reference, target.candidate)
    check_topk(target.model, [s.index_topk for s in settings if s is not None], f"{ledger}: index_topk")
    return parsed


@investigate_app.command("run")
def run_command(
    ledger: Path = typer.Argument(..., help="The ledger (investigation.toml)."),
    out: Path = typer.Option(..., "--out", help="Run directory (kept; a second run resumes it)."),
    allow_outside: bool = typer.Option(
        False, "--allow-outside", help="Accept ledger paths (patches, env file, sources) outside its folder."
    ),
    prefill_chunk: int = typer.Option(
        None,
        "--prefill-chunk",
        help="Run prompts through the KV cache in chunks of this many tokens (overrides [target] prefill_chunk; docs/scale.md).",
    ),
    max_memory: str = typer.Option(
        None,
        "--max-memory",
        help="Bound the run's memory (e.g. 4GiB): batches sized to it; on a GPU the process is capped "
        "at it, so several runs share one device (docs/perf.md).",
    ),
    api_key: str = API_KEY,
    serving_factors: bool = typer.Option(
        False,
        "--serving-factors",
        help="Live route: when recall is lost, name the serving factor (prefix cache, batch, repeat) that "
        "reproduces it (a bounded serving-factors experiment; docs/serving_factors.md).",
    ),
    force: bool = FORCE,
) -> None:
    """Run the ledger: cheap questions, symptom, checks in tier order, fixes, verdicts, DIAGNOSIS."""
    from needlescope.dsa.placement import parse_max_memory

    again = "rerun the same command to continue (finished steps and cases are kept)"
    parse_max_memory(max_memory, 1)  # a bad size is one line, exit 2, before anything runs
    with on_interrupt(measured_saved(out), again), guard(out, "investigate run", force):
        parsed = _check_ledger_fits(ledger, allow_outside)  # the ledger is parsed once
        findings, md = run_investigation_cli(
            parsed,
            out,
            allow_outside,
            prefill_chunk,
            api_key,
            serving_factors=serving_factors,
            max_memory=max_memory,
            device=parsed.target.device,
        )
    for s in findings.suspects:
        console.say("  tier {} {}: [bold]{}[/] - {}", s.tier, s.id, s.verdict, s.reason)
    console.say("root cause: [bold]{}[/]", findings.root_cause)
    ch = findings.characterization
    if findings.route == "blackbox" and ch:  # no suspect is tested from outside: the class is the finding
        console.say("what kind of bug: [bold]{}[/] - {}", ", ".join(ch["classes"]), ch["text"])
        if ch.get("next"):
            console.print(f"next: {ch['next']}", soft_wrap=True)
    console.print(f"wrote {out / 'verdicts.json'}, {md} and DIAGNOSIS.html")
    symptom = findings.symptom
    if symptom.get("errors"):
        # A target that failed is never a clean run: the verdicts rest on the answered cases only.
        from needlescope.cli.output import err_console

        err_console.print(
            f"{symptom['errors']} of {symptom['cases']} live request(s) failed (recorded as errors, not "
            f"scored); the verdicts rest on the answered cases: {again} once the endpoint answers",
            soft_wrap=True,
        )
        raise typer.Exit(1)
