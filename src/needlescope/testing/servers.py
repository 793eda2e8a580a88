"""Child servers for tests: the scripted server started through the one READY handshake."""

from __future__ import annotations

import sys

from needlescope.serve.launch import ChildServer

__all__ = ["scripted"]


def scripted(**opts: object) -> ChildServer:
    """``python -m needlescope.testing.scripted_server`` with ``opts`` as flags (underscores
    become dashes; ``port`` defaults to 0, a free port, and ``window`` to 10000), not yet started."""
    opts = {"port": 0, "window": 10_000, **opts}
    argv = [sys.executable, "-m", "needlescope.testing.scripted_server"]
    for k, v in opts.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return ChildServer(argv)
