"""Wall time of ``needlescope serve-probe-explain`` (the shipped organism, or ``--model DIR``).

    python bench/serve_probe_explain_time.py
    python bench/serve_probe_explain_time.py --model DIR [--lengths 256,512,1024 --trials 2]

Prints one JSON line: command, seconds, machine. Not a test: numbers go to docs/perf.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--lengths")
    ap.add_argument("--trials")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shown = ["needlescope", "serve-probe-explain"]
        for flag in ("model", "lengths", "trials"):
            if getattr(args, flag):
                shown += [f"--{flag}", getattr(args, flag)]
        cmd = [sys.executable, "-m", "needlescope.cli.main", *shown[1:], "--out", os.path.join(tmp, "out")]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wall = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "command": " ".join(shown),
                "wall_s": round(wall, 1),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
