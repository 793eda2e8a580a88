"""Requests `probe --bisect` needs against a full grid of the same resolution (scripted server).

    .venv/bin/python bench/bisect_requests.py [--lo 256 --hi 4096 --resolution 16]

For each planted collapse length B (the scripted server answers with a wrong digit from B tokens
on: `--fault near_miss --fault-from B`), runs the real bisection over [lo, hi] against a loopback
scripted server and prints: the bracket found, whether it holds B, the chat requests sent, and
those a plain grid at the same resolution would send. Once without kernel boundaries and once
with `--boundaries 4,64,256` (fine offsets around multiples of each, plus a mod-4 residue sweep).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig


def _server(collapse: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "needlescope.testing.scripted_server",
            "--port",
            "0",
            "--window",
            "1000000",
            "--fault",
            "near_miss",
            "--fault-from",
            str(collapse),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lo", type=int, default=256)
    p.add_argument("--hi", type=int, default=4096)
    p.add_argument("--resolution", type=int, default=16)
    p.add_argument("--collapses", default="300,777,1500,2049,3999")
    args = p.parse_args()
    print(
        f"# {platform.node()} {platform.machine()} python {platform.python_version()} {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"range [{args.lo}, {args.hi}], resolution {args.resolution}, depths 0,50,100, 1 trial (3 cases a length)\n"
    )
    print("| planted collapse | boundaries | bracket found | holds it | requests | full grid | ratio |")
    print("|---|---|---|---|---|---|---|")
    for collapse in (int(x) for x in args.collapses.split(",")):
        for boundaries in ((), (4, 64, 256)):
            proc, url = _server(collapse)
            try:
                with tempfile.TemporaryDirectory() as d:
                    cfg = ProbeConfig(
                        base_urls=(url,),
                        model="scripted",
                        lengths=(args.lo, args.hi),
                        depths=(0, 50, 100),
                        trials=1,
                        out=Path(d),
                        concurrency=4,
                    )
                    res = run_bisect(cfg, BisectConfig(resolution=args.resolution, boundaries=boundaries))
            finally:
                proc.kill()
                proc.wait()
            holds = res["bracketed"] and res["last_pass"] < collapse <= res["collapse_length"]
            print(
                f"| {collapse} | {','.join(map(str, boundaries)) or 'none'} | ({res['last_pass']}, {res['collapse_length']}] "
                f"| {'yes' if holds else 'NO'} | {res['requests_used']} | {res['full_grid_requests']} "
                f"| {100 * res['request_ratio']:.1f}% |"
            )


if __name__ == "__main__":
    main()
