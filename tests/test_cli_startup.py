"""Starting the CLI costs no torch import: probe, compare and watch users never need it."""

import subprocess
import sys


def test_the_cli_and_its_help_import_no_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from needlescope.cli.main import app\n"
        "for args in (['--help'], ['probe', '--help'], ['serve', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout[:300]
