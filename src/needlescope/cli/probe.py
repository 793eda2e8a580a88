"""``needlescope probe``: token-exact recall sweep against OpenAI-compatible servers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from needlescope.cli.interrupts import on_interrupt, store_saved
from needlescope.cli.output import console, err_console
from needlescope.cli.outputs import FORCE, guard, recording_runs
from needlescope.cli.probe_options import PROBE_FLAGS, build, config_default, option_group
from needlescope.cli.progress import ProgressView
from needlescope.errors import ProbeError
from needlescope.progress import Event
from needlescope.report.bisect import residue_lines, step_line
from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig, parse_int_list
from needlescope.run.difficulty import probe_with_difficulty


@option_group(ProbeConfig, PROBE_FLAGS)
def probe_command(
    flags: dict,
    base_url: list[str] = typer.Option(
        ..., "--base-url", metavar="<url>", help="Server URL (root or ending in /v1); repeat to spread load."
    ),
    model: str = typer.Option(..., "--model", help="Model name as served in /v1/models."),
    out: Path = typer.Option(config_default(ProbeConfig, "out"), "--out", help="Output directory."),
    resume: bool = typer.Option(
        config_default(ProbeConfig, "resume"),
        "--resume",
        help="Continue the run in --out, re-running unfinished cases only.",
    ),
    bundles: int = typer.Option(
        config_default(ProbeConfig, "bundles"),
        "--bundles",
        help="Reproducer bundles to write for failing cases.",
    ),
    bisect: bool = typer.Option(
        False, "--bisect", help="Search [min, max] of --lengths for the collapse length instead of a grid."
    ),
    resolution: int = typer.Option(
        config_default(BisectConfig, "resolution"),
        "--resolution",
        help="--bisect: bracket width to stop at, in tokens.",
    ),
    ci_width: float = typer.Option(
        config_default(BisectConfig, "ci_width"),
        "--ci-width",
        help="--bisect: raise trials until a 95% CI near the threshold is this wide.",
    ),
    boundaries: str = typer.Option(
        config_default(BisectConfig, "boundaries"),
        "--boundaries",
        help="--bisect: kernel lengths (e.g. 4,64,128,256); default from /get_server_info.",
    ),
    force: bool = FORCE,
) -> None:
    """Measure needle recall across lengths and depths and find where it collapses."""
    cfg = build(
        ProbeConfig, flags, base_urls=tuple(base_url), model=model, out=out, resume=resume, bundles=bundles
    )
    if bisect:
        bis = BisectConfig(
            resolution=resolution,
            ci_width=ci_width,
            boundaries=parse_int_list(boundaries, "--boundaries") if boundaries is not None else None,
        )
        with (
            _interrupts(cfg),
            guard(cfg.out, "probe", force),
            _target_failures(cfg),
            ProgressView(console) as view,
        ):
            res = run_bisect(cfg, bis, probe_events(view))
        render_bisect(res, cfg.out)
        return
    with _interrupts(cfg), guard(cfg.out, "probe", force), _target_failures(cfg):
        summary = run_with_progress(cfg)
    render_summary(summary, cfg.out)
    empty = summary["cells_without_data"]
    if empty:
        err_console.say(
            "[bold red]error:[/] {} of {} cells have no scored case (every request failed or missed its "
            "length); see {}/report.md and results.jsonl",
            empty,
            len(summary["cells"]),
            cfg.out,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _interrupts(cfg: ProbeConfig):
    """Ctrl-C says how many cases the store holds and how to resume (``cli.interrupts``)."""
    from needlescope.run.probe import STORE_NAME

    return on_interrupt(store_saved(cfg.out / STORE_NAME), "rerun the same command with --resume to continue")


@contextmanager
def _target_failures(cfg: ProbeConfig) -> Iterator[None]:
    """A target that fails outside a case's request (a bisection counting the tokens of its next
    lengths when the server dies) ends the run in one line, exit 1: every finished case is in
    the store, and ``--resume`` goes on from there."""
    from needlescope.run.probe import STORE_NAME

    try:
        yield
    except ProbeError as exc:
        saved = (cfg.out / STORE_NAME).is_file()
        err_console.say(
            "[bold red]target failed:[/] {}; {}",
            exc,
            "the finished cases are saved: rerun the same command with --resume to continue"
            if saved
            else "nothing was saved",
            soft_wrap=True,
        )
        raise typer.Exit(1) from None


def run_with_progress(cfg: ProbeConfig) -> dict:
    """Run the probe with progress shown (``cli.progress``); a bad input prints its one error line
    and nothing else, because nothing is shown before the target is checked."""
    with ProgressView(console) as view:
        return probe_with_difficulty(cfg, recording_runs(probe_events(view), cfg.out, "probe"))


def probe_events(view: ProgressView) -> Event:
    """The probe's (and a bisection's or comparison's) events, rendered: notes for what it chose,
    the case building and each run as progress tasks (a run's detail: recall so far, errors)."""
    state = {"label": "probe", "task": "probe", "todo": 0, "ok": 0, "correct": 0, "error": 0}
    used: dict[str, int] = {}

    def start_run(todo: int) -> None:
        # Each run is its own task: a side, a difficulty level and a bisection step get a bar each.
        used[state["label"]] = used.get(state["label"], 0) + 1
        n = used[state["label"]]
        state.update(
            task=state["label"] if n == 1 else f"{state['label']} #{n}", todo=todo, ok=0, correct=0, error=0
        )
        view.update(state["task"], 0, todo, "")

    def on_event(name: str, payload: dict) -> None:
        if name == "value_digits":
            view.note(f"needle values: {payload['value_digits']} digits, from {payload['source']}")
        elif name == "lengths_skipped":
            view.note(
                f"WARNING: skipping lengths {', '.join(map(str, payload['skipped']))}: beyond the target's "
                f"context of {payload['context']} tokens ({payload['from']}); probing {payload['kept']}"
            )
        elif name == "difficulty_level":
            view.note(difficulty_line(payload))
        elif name == "side":
            state["label"] = f"side {payload['side']}"
            view.note(f"probing side {payload['side']}: {', '.join(payload['base_urls'])}")
        elif name == "progress":
            view.update(
                f"{state['label']}: {payload['task']}", payload["done"], payload["total"], payload["detail"]
            )
        elif name == "bisect_step":
            state["label"] = payload["phase"]
            if payload["lengths"]:
                lengths = ", ".join(map(str, payload["lengths"]))
                view.note(f"{payload['phase']}: {lengths} tokens ({payload['requests']} requests)")
            start_run(payload["requests"])
        elif name == "bisect_evidence":
            view.note(step_line(payload))
        elif name == "run_start":
            start_run(payload["todo"])
        elif name == "result":
            ok = payload.get("status") == "ok"
            state["ok"] += int(ok)
            state["correct"] += int(ok and bool(payload.get("correct")))
            state["error"] += int(not ok)
            recall = f"{state['correct'] / state['ok']:.2f}" if state["ok"] else "-"
            done = state["ok"] + state["error"]
            view.update(state["task"], done, state["todo"], f"recall {recall}  errors {state['error']}")

    return on_event


def difficulty_line(payload: dict) -> str:
    """One line per auto-difficulty level tried on the reference."""
    recall = "no data" if payload["recall"] is None else f"{payload['recall']:.2f}"
    return (
        f"difficulty level {payload['level']}: {payload['distractors']} distractors, "
        f"{payload['value_digits']}-digit values: reference recall {recall} (n={payload['n']})"
    )


def render_bisect(res: dict, out: Path) -> None:
    console.print(res["message"], style="bold")
    for line in residue_lines(res["residue"]):
        console.print(line, highlight=False)
    console.print(
        f"requests: {res['requests_used']} vs {res['full_grid_requests']} for a full grid at {res['resolution']} "
        f"tokens ({100 * res['request_ratio']:.1f}%)"
    )
    console.print(f"wrote {out}/bisect.json, bisect.md, results.jsonl")
    if not res["bracketed"] and not any(r["flagged"] for r in res["residue"]):
        # Nothing found in the range: the user's range is wrong for this server.
        raise typer.Exit(2)


def render_summary(summary: dict, out: Path) -> None:
    console.say("kind [bold]{}[/]  model [bold]{}[/]", summary["kind"], summary["model"])
    for line in summary["headline"]:
        console.print(line, style="bold", markup=False, highlight=False, soft_wrap=True)
    errors = sum(cell["errors"] for cell in summary["cells"])
    if errors:
        console.print(f"{errors} requests failed and were counted as errors, not misses", style="yellow")
    if summary["length_mismatches"]:
        console.print(
            f"WARNING: {summary['length_mismatches']} case(s) have a length disagreement "
            f"({summary['unreachable_lengths']} unreachable, {summary['server_length_mismatches']} counted "
            "differently by the server); see report.md",
            style="yellow",
        )
    failures = summary.get("failures")
    if failures and failures["misses"]:
        console.print("misses by class: " + ", ".join(f"{k} {v}" for k, v in failures["counts"].items() if v))
    endpoints = summary.get("endpoints")
    if endpoints and endpoints["differs"]:
        console.print(f"differs from the other endpoints: {', '.join(endpoints['differs'])}", style="red")
    graded = summary.get("graded")
    if graded is not None:
        console.print(graded["note"], highlight=False)
        for g in (g for g in graded["lengths"] if g["margin_tokens"]):
            console.print(
                f"  {g['length']} tokens: median token margin {g['margin_p50']:+.2f} nats, min "
                f"{g['margin_min']:+.2f}, {g['below_threshold']}/{g['n']} answers won by < "
                f"{graded['margin_threshold']:g}",
                highlight=False,
            )
    console.print(f"wrote {out}/summary.json, report.md, heatmap.png, results.jsonl")
