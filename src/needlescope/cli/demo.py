"""``needlescope demo``: the main job on the embedded default, the shipped organism.

Serves the checkpoint (``--model``, default ``organism``) twice, with reference indexer numerics
and with a deployment-like setting (fp8 keys, ``index_topk`` 64, the built-in
``fault:indexer_page_table``), probes both with multiturn needles, rank-dumps the failing
case, tries the fixes and writes ``DIAGNOSIS.md`` (``needlescope.organism.demo``). A progress
bar advances through the six phases.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

PHASES = ("serve", "probe reference", "probe deployment", "rank dump", "fixes", "report")


def demo_command(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Output directory (replaced)."),
    model: str = typer.Option("organism", "--model", help="'organism' or a DeepSeek-V4 checkpoint dir."),
    deploy_index_k: str = typer.Option("fp8_e4m3", help="Deployment-like index-key precision."),
    deploy_index_topk: int = typer.Option(64, help="Deployment-like index_topk."),
    deploy_patch: str = typer.Option(
        "fault:indexer_page_table",
        help="Patch of the deployment-like server: a Python file, a built-in fault:NAME, or 'none'.",
    ),
    lengths: str = typer.Option("256,512,1024", help="Probe lengths (comma-separated)."),
    trials: int = typer.Option(2, help="Trials per cell."),
    device: str = typer.Option("cpu", help="cpu | cuda | cuda:N"),
) -> None:
    """Probe the organism under reference and deployment numerics and explain the difference."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from needlescope.dsa.emulate import Numerics
    from needlescope.organism.demo import DemoConfig, run_organism_demo
    from needlescope.run.config import parse_int_list

    cfg = DemoConfig(
        model=model,
        out=out,
        deployment=Numerics(index_k=deploy_index_k, index_topk=deploy_index_topk),
        patch=None if deploy_patch == "none" else deploy_patch,
        lengths=tuple(parse_int_list(lengths, "--lengths")),
        trials=trials,
        device=device,
    )
    if out.exists():
        shutil.rmtree(out)
    console = Console()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("demo", total=len(PHASES))

        def phase(name: str, info: dict) -> None:
            done = PHASES.index(name) if name in PHASES else 0
            detail = " ".join(f"{k}={v}" for k, v in info.items())
            progress.update(task, completed=done, description=f"{name} {detail}".strip())

        path = run_organism_demo(cfg, phase)
        progress.update(task, completed=len(PHASES), description="done")
    console.print(path.read_text(encoding="utf-8"), highlight=False, markup=False)
    console.print(f"wrote {out}/DIAGNOSIS.md")
