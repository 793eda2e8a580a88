"""Organism servers shared by test files: ``needlescope serve --model organism`` with the same
flags is started once per xdist worker and handed to every file asking for those flags, instead
of once per file (a start is seconds of imports and a model load; four files serve the plain
organism, two the page-table deployment, two the lm-eval settings)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from needlescope.serve.launch import ServerProcess


class SharedOrganismServers:
    """``get(*flags)`` -> the root URL of a running ``serve --model organism --port 0 *flags``.

    At most ``alive`` run at once: asking for another stops the one asked for least recently
    (memory: each holds half a GiB). A file keeps its URL only while its tests run (module
    fixtures), and one test asks for at most ``alive`` servers, so none is stopped under a test.
    Tests of a server's own state (its queue, its prefix cache, its key) start their own.
    """

    def __init__(self, alive: int = 2, timeout: float = 300.0) -> None:
        self.alive = alive
        self.timeout = timeout
        self._running: OrderedDict[tuple[str, ...], ServerProcess] = OrderedDict()
        self._lock = threading.Lock()  # a file may start its servers from a thread pool

    def get(self, *flags: str) -> str:
        with self._lock:
            server = self._running.get(flags)
            if server is not None and server.proc.poll() is None:
                self._running.move_to_end(flags)
                return server.url
            self._running.pop(flags, None)  # one that died under an earlier test is started again
            while len(self._running) >= self.alive:
                self._running.popitem(last=False)[1].stop()
            server = ServerProcess(["--model", "organism", "--port", "0", *flags], timeout=self.timeout)
            self._running[flags] = server.start()
            return server.url

    def stop(self) -> None:
        with self._lock:
            while self._running:
                self._running.popitem()[1].stop()
