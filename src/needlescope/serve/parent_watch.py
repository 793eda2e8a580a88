"""The child's half of "no server outlives the process that started it".

``ChildServer`` puts its own pid in the child's ``NEEDLESCOPE_PARENT_PID``; a needlescope server
started that way calls ``exit_with_parent(os.environ)`` at start-up, which watches from a daemon
thread and sends the process SIGTERM (its normal, graceful stop) once its parent is gone, then
exits hard if that stop has not ended it. Linux's ``PR_SET_PDEATHSIG`` alone is not enough:
it fires when the starting *thread* ends, so a server started from a pool thread would die with
the thread, and one started elsewhere would outlive a SIGKILLed parent.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import MutableMapping

__all__ = ["PARENT_ENV", "exit_with_parent"]

PARENT_ENV = "NEEDLESCOPE_PARENT_PID"


def _watch(parent: int, interval: float, grace: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os._exit(1)  # SIGTERM was handled without ending the process (a server busy in a request)


def exit_with_parent(
    environ: MutableMapping[str, str], *, interval: float = 0.5, grace: float = 10.0
) -> bool:
    """Start the watch when ``environ`` names a parent pid; True when it was started.

    The variable is taken out of ``environ``: a process this one starts in turn must not watch
    its grandparent. A parent that is already gone (this process was re-parented before it got
    here) ends the process at the first check. A malformed value is ignored: the variable is
    ours, not the user's."""
    value = environ.pop(PARENT_ENV, "")
    if not value.isdigit():
        return False
    args = (int(value), interval, grace)
    threading.Thread(target=_watch, args=args, name="parent-watch", daemon=True).start()
    return True
