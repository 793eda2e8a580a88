"""Running probe cases: the durable result store and the bounded-concurrency scheduler."""

from needlescope.run.scheduler import run_cases
from needlescope.run.store import ResultStore

__all__ = ["ResultStore", "run_cases"]
