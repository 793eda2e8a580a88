"""The ``needlescope`` command: builds configs from flags, calls the library, renders results."""

from __future__ import annotations

import errno
import os
import sqlite3
import sys

import typer

from needlescope import __version__
from needlescope.cli import (  # noqa: F401  (they register their commands)
    indexer_capture,
    indexer_diff,
    indexer_dump,
    indexer_rank,
    indexer_sweep,
    indexer_topk_audit,
)
from needlescope.cli.audit import audit_command
from needlescope.cli.compare import compare_command
from needlescope.cli.engine_state import engine_state_command
from needlescope.cli.indexer import indexer_app
from needlescope.cli.investigate import investigate_app
from needlescope.cli.kernels import kernels_app
from needlescope.cli.oracle import oracle_app
from needlescope.cli.organism import organism_app
from needlescope.cli.output import console, err_console, typer_app
from needlescope.cli.probe import probe_command
from needlescope.cli.replay import replay_command
from needlescope.cli.serve import serve_command
from needlescope.cli.serve_probe_explain import serve_probe_explain_command
from needlescope.cli.serving_factors import serving_factors_command
from needlescope.cli.watch import canary_command, health_command
from needlescope.errors import BadInput
from needlescope.serve.parent_watch import exit_with_parent

app = typer_app(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find, explain and fix long-context recall failures.",
)


def _version(show: bool) -> None:
    if show:
        console.print(f"needlescope {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print needlescope's version and exit."
    ),
) -> None:
    """Find, explain and fix long-context recall failures."""


app.command("probe")(probe_command)
app.command("serve-probe-explain")(serve_probe_explain_command)
app.command("compare")(compare_command)
app.command("replay")(replay_command)
app.add_typer(organism_app, name="organism")
app.add_typer(oracle_app, name="oracle")
app.command("engine-state")(engine_state_command)
app.command("serving-factors")(serving_factors_command)
app.add_typer(indexer_app, name="indexer")
app.add_typer(kernels_app, name="kernels")
app.command("serve")(serve_command)
app.add_typer(investigate_app, name="investigate")
app.command("audit")(audit_command)
app.command("health")(health_command)
app.command("canary")(canary_command)

# The extra that installs each optional dependency (pyproject.toml's optional-dependencies).
EXTRA_OF = {
    "torch": "model",
    "transformers": "model",
    "safetensors": "model",
    "tokenizers": "model",
    "fastapi": "model",
    "uvicorn": "model",
    "prometheus_client": "watch",
    "pynvml": "watch",
    "triton": "gpu",
}


# Write failures that are the machine's room, not a bug: a full disk, a quota, a file-size limit.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _out_of_room(exc: Exception) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        return "disk is full" in str(exc) or "disk I/O error" in str(exc)
    return isinstance(exc, OSError) and exc.errno in _NO_ROOM


def main() -> None:
    exit_with_parent(os.environ)  # a no-op unless a ChildServer started this process
    # Click handles usage errors itself (exit 2); BadInput from the library is printed as one line.
    try:
        app()
    except BadInput as exc:
        err_console.say("[bold red]error:[/] {}", exc, soft_wrap=True)
        sys.exit(2)
    except (OSError, sqlite3.OperationalError) as exc:
        # A full disk, a quota or a file-size limit mid-run: what was saved is kept (the stores
        # commit per case), so say so and how to go on, in one line; anything else is a bug.
        if not _out_of_room(exc):
            raise
        where = getattr(exc, "filename", None) or "the output folder"
        why = getattr(exc, "strerror", None) or str(exc)
        err_console.say(
            "[bold red]error:[/] cannot write {}: {}: free space or choose another --out; what was saved "
            "is kept, so rerun the same command with --resume where it takes one",
            where,
            why,
            soft_wrap=True,
        )
        sys.exit(2)
    except ModuleNotFoundError as exc:
        # A missing capability, not a bug: say which extra brings it.
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRA_OF:
            raise
        extra = EXTRA_OF[missing]
        err_console.print(
            f"error: this command needs {missing}, which the [{extra}] extra installs: "
            f"pip install 'needlescope[{extra}]'",
            soft_wrap=True,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
