"""When the executor may read a unit's weights: once the update the step needs is in. Asked blocking (wait until it
is) or not (is it now?), so that a copy whose weights are already current is queued before one that must wait: the
head's H2D right behind the last layer's, and layer 0's before the embedding rows' gather where layer 0's update
is in first (megatrain/engine/executor.py). The order of the copies changes, never what they read."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from megatrain.engine.resident import ResidentUnits
from megatrain.memory.versions import VersionTable
from megatrain.model.layout import Unit
from megatrain.telemetry import Recorder


class WeightWaits:
    """Every unit's weights are current (a lone executor, the tests): nothing to wait for."""

    def wait(self, unit: Unit) -> None:
        """Blocks until `unit`'s weights may be read."""

    def ready(self, unit: Unit) -> bool:
        """Whether `unit`'s weights may be read now; never blocks."""
        return True

    def wait_first(self, units: Sequence[Unit]) -> Unit:
        """Blocks until one of `units` may be read; returns it (the first in `units`' order where several may)."""
        first = next((u for u in units if self.ready(u)), None)
        return first if first is not None else self._wait_any(units)

    def _wait_any(self, units: Sequence[Unit]) -> Unit:
        """Blocks until one of `units`, none of which may be read now, may; returns it (here: the first, waited for)."""
        self.wait(units[0])
        return units[0]


NO_WAITS = WeightWaits()


class VersionWaits(WeightWaits):
    """A unit's weights are current once its row of the version table reaches `version` (every optimizer worker
    applied that update). `check` runs while a wait lasts (it raises where an update failed); the waits are recorded
    as the optimizer's in `rec`, where given."""

    def __init__(self, table: VersionTable, version: int, check: Callable[[], None] | None = None,
                 rec: Recorder | None = None):
        self.table, self.version, self.check, self.rec = table, version, check, rec

    def ready(self, unit: Unit) -> bool:
        return self.table.reached(unit.index, self.version)

    def wait(self, unit: Unit) -> None:
        self.wait_first([unit])

    def _wait_any(self, units: Sequence[Unit]) -> Unit:
        with self.rec.wait("optimizer", units[0].index) if self.rec is not None else contextlib.nullcontext():
            index = self.table.wait_first([u.index for u in units], self.version, check=self.check)
        return next(u for u in units if u.index == index)


class ResidentCurrent(WeightWaits):
    """`streamed`'s word on every unit but those resident on the device: this process updates them, in order with
    its own work, so they are always current."""

    def __init__(self, streamed: WeightWaits, resident: ResidentUnits):
        self.streamed, self.resident = streamed, resident

    def ready(self, unit: Unit) -> bool:
        return self.resident.holds(unit) or self.streamed.ready(unit)

    def wait(self, unit: Unit) -> None:
        if not self.resident.holds(unit):
            self.streamed.wait(unit)

    def _wait_any(self, units: Sequence[Unit]) -> Unit:
        return self.streamed.wait_first(units)
