"""Every GPU kernel variant the Triton paths launch compiles for sm_90 (Hopper), on the CPU.

The rest of the kernel tests run under Triton's interpreter, which accepts code the compiler
rejects; this runs Triton's compiler and the bundled ptxas (tests/sm90_compile.py) in a
subprocess without TRITON_INTERPRET, so a kernel that would fail to build on the GPU machine
fails here first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_variant_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sm90_compile.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(("ok ", "FAIL "))]
    assert run.returncode == 0 and len(lines) >= 13, run.stdout + run.stderr[-3000:]
    assert all(ln.startswith("ok ") for ln in lines), "\n".join(lines)
