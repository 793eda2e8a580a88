"""``needlescope demo``: the main job on the embedded default target.

Until the model organism ships, the embedded default is the scripted reference server
(``needlescope.testing.scripted_server``), which recalls a needle only within its last ``window``
tokens and so has a known cliff: the demo shows the probe finding it.
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
) -> None:
    """Probe the embedded default target with multiturn needles and write the four outputs."""
    if out.exists():
        shutil.rmtree(out)
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
