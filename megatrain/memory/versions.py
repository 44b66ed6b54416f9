"""The version table: per unit of the model, the update each optimizer worker applied to it; reading, waiting on it.

The table is a segment of the arena ([units, columns] int64, shared by every process of a node): column w is
optimizer worker w's count of updates applied to the unit; with several nodes a last column is the update whose
weights every node has (megatrain/distributed/node_exchange.py writes it). The executor waits on a unit's row
before loading its weights (or on the first of several units' rows, or asks without waiting whether a row is there:
megatrain/engine/weight_waits.py), the node exchange before sending them, the driver reads the range after a fault.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

POLL_SECONDS = 0.0005  # how often a waiter looks at the table: a unit's update takes milliseconds

ALL_COLUMNS = slice(None)


class VersionTable:
    """A view of the arena's version table as [units, columns]."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def version(self, unit: int, columns: slice = ALL_COLUMNS) -> int:
        """The update every one of `columns` has applied to `unit`."""
        return int(self.table[unit, columns].min())

    def reached(self, unit: int, version: int, columns: slice = ALL_COLUMNS) -> bool:
        """Whether `unit` has reached `version` in `columns`, now: it never waits."""
        return self.version(unit, columns) >= version

    def range(self) -> tuple[int, int]:
        """(min, max) of the whole table: the update every unit has, and the newest any part of one has."""
        return int(self.table.min()), int(self.table.max())

    def wait(self, unit: int, version: int, columns: slice = ALL_COLUMNS, timeout: float | None = None,
             check: Callable[[], None] | None = None, check_seconds: float = 0.1) -> bool:
        """Blocks until `unit` reaches `version` in `columns` (wait_first of it alone). False once `timeout` seconds
        passed without it."""
        return self.wait_first([unit], version, columns, timeout, check, check_seconds) is not None

    def wait_first(self, units: Sequence[int], version: int, columns: slice = ALL_COLUMNS,
                   timeout: float | None = None, check: Callable[[], None] | None = None,
                   check_seconds: float = 0.1) -> int | None:
        """Blocks until one of `units` reaches `version` in `columns`, looking every POLL_SECONDS; returns it (the
        first in `units`' order where several have). Meanwhile `check` runs every `check_seconds` (it raises to stop
        the wait, e.g. when an update it waits for failed). None once `timeout` seconds passed without any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_check = time.monotonic()
        while (first := next((u for u in units if self.reached(u, version, columns)), None)) is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(POLL_SECONDS)
            if check is not None and time.monotonic() - last_check > check_seconds:
                check()
                last_check = time.monotonic()
        return first

    def set(self, unit: int, column: int, version: int) -> None:
        self.table[unit, column] = version


def settled_range(read_range: Callable[[], tuple[int, int]], quiet: float = 0.3, timeout: float = 30.0
                  ) -> tuple[int, int]:
    """`read_range()` (a version table's (min, max), or several nodes' together) once it stayed the same for `quiet`
    seconds: the updates already queued at the workers have finished. The last one read after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = read_range()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(POLL_SECONDS)
    return last  # type: ignore[return-value]
