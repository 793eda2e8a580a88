"""``needlescope demo``: the main job on the embedded default target.

Until the trained organism ships, the embedded default is the scripted reference server
(``needlescope.testing.scripted_server``), which recalls a needle only within its last ``window``
tokens and so has a known cliff: the demo shows the probe finding it.

``--model DIR`` runs the organism demo on any local DeepSeek-V4 checkpoint instead: serve it
with reference and deployment-like indexer numerics, probe both, rank-dump the failing case,
try the fixes and write DIAGNOSIS.md (``needlescope.organism.demo``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import typer

from needlescope.cli.probe import render_summary, run_with_progress
from needlescope.run.config import ProbeConfig

WINDOW = 1500


def demo_command(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Output directory (replaced)."),
    model: str = typer.Option(
        None,
        "--model",
        help="A DeepSeek-V4 checkpoint dir: run the organism demo on it (writes DIAGNOSIS.md).",
    ),
    deploy_index_k: str = typer.Option("fp8_e4m3", help="Deployment-like index-key precision (--model)."),
    deploy_index_topk: int = typer.Option(16, help="Deployment-like index_topk (--model)."),
    lengths: str = typer.Option("256,512,1024", help="Probe lengths for --model (comma-separated)."),
    trials: int = typer.Option(2, help="Trials per cell for --model."),
) -> None:
    """Probe the embedded default target with multiturn needles and write the four outputs."""
    if out.exists():
        shutil.rmtree(out)
    if model is not None:
        _organism_demo(out, model, deploy_index_k, deploy_index_topk, lengths, trials)
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "needlescope.testing.scripted_server", "--port", "0", "--window", str(WINDOW)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline().split()
        if len(line) != 2 or line[0] != "READY":
            raise RuntimeError(f"the scripted server did not start (said {line!r})")
        cfg = ProbeConfig(
            base_urls=(f"http://127.0.0.1:{line[1]}/v1",),
            model="scripted",
            kind="multiturn",
            lengths=(500, 1000, 2000, 4000),
            depths=(0, 10, 25, 50, 75, 90, 100),
            trials=3,
            seed=0,
            out=out,
        )
        summary = run_with_progress(cfg)
        render_summary(summary, out)
    finally:
        server.terminate()
        server.wait(timeout=10)


def _organism_demo(out: Path, model: str, index_k: str, index_topk: int, lengths: str, trials: int) -> None:
    from rich.console import Console

    from needlescope.dsa.emulate import Numerics
    from needlescope.organism.demo import DemoConfig, run_organism_demo
    from needlescope.run.config import parse_int_list

    console = Console()
    cfg = DemoConfig(
        model=model,
        out=out,
        deployment=Numerics(index_k=index_k, index_topk=index_topk),
        lengths=tuple(parse_int_list(lengths, "--lengths")),
        trials=trials,
    )
    with console.status("starting") as status:

        def phase(name: str, info: dict) -> None:
            status.update(f"[bold]{name}[/] {' '.join(f'{k}={v}' for k, v in info.items())}")
            console.print(f"[bold]phase[/] {name}", highlight=False)

        path = run_organism_demo(cfg, phase)
    console.print(path.read_text(encoding="utf-8"), highlight=False, markup=False)
