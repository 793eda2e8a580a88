"""Issue 38, item 17: output piped to a file is never hard-wrapped (a `next:` command stays on one
line), and a progress detail is shortened at a word boundary, never inside a setting string."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from needlescope.cli.output import clip

CLI = [sys.executable, "-m", "needlescope.cli.main"]


def test_a_long_line_piped_to_a_file_is_one_line(tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-for-a-ledger-" * 3) / "inv"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([*CLI, "investigate", "init", str(deep)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("next: ")]
    assert line == f"next: needlescope investigate run {deep / 'investigation.toml'} --out {deep}"
    assert len(line) > 80


def test_the_init_hint_is_the_makefiles_next_line(tmp_path):
    """Issue 54 item 17: `make demo` runs `investigate init demo-out`, then its next line; the
    `next:` hint init prints is that line (it said `--out demo-out/out`)."""
    make = (Path(__file__).parents[1] / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()
    init, run = (x.strip().split("$(NEEDLESCOPE) ", 1)[1] for x in make[1:3])
    assert init.endswith("investigate init demo-out")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run(
        [*CLI, "investigate", "init", "demo-out"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("next: ")]
    assert line == f"next: needlescope {run}"


def test_clip_never_cuts_inside_a_word():
    what = "candidate k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"
    short = clip(what, 60)
    assert short == "candidate k=fp8_e4m3 q=fp32 acc=fp32 topk=64…" and len(short) <= 60
    assert clip("short", 60) == "short"


def test_version():
    import needlescope

    res = subprocess.run([*CLI, "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == f"needlescope {needlescope.__version__}\n"
