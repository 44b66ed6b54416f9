"""What SIGTERM does to a megatrain actor process: its cleanup, then a quiet exit.

SIGTERM reaches an actor when its job ends before a `ray.kill` has landed (the driver exits or is stopped, and the
raylet terminates the job's workers) or when someone runs `kill` on it. Ray's own handler raises SystemExit wherever
the main thread happens to be; when that is an object's `__del__` (an actor handle collected at teardown) Python
prints the ignored exception's traceback, which reaches the driver's log. A terminated actor has nothing left to
report, so it releases what outlives it and exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def exit_on_sigterm(cleanup: Callable[[], None] | None = None) -> None:
    """From an actor's __init__ (Ray runs it on the process's main thread, where handlers are installed): on SIGTERM
    run `cleanup` (e.g. unlink shared memory) and exit with status 0, a requested stop rather than a failure."""

    def stop(signum: int, frame: object) -> None:
        try:
            if cleanup is not None:
                cleanup()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # not SystemExit: raised inside a __del__ it is only printed, and the process lives on

    signal.signal(signal.SIGTERM, stop)
