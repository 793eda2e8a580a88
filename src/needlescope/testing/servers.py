"""Child servers for tests: the scripted server started through the one READY handshake."""

from __future__ import annotations

import sys

from needlescope.serve.launch import ChildServer

__all__ = ["scripted"]


def scripted(**opts: object) -> ChildServer:
    """``python -m needlescope.testing.scripted_server --port 0`` with ``opts`` as flags
    (underscores become dashes; ``window`` defaults to 10000), not yet started."""
    opts.setdefault("window", 10_000)
    argv = [sys.executable, "-m", "needlescope.testing.scripted_server", "--port", "0"]
    for k, v in opts.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return ChildServer(argv)
