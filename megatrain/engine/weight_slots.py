"""The weights' way onto the device: two buffers that decoder layers rotate through, each filled on the H2D
stream while compute runs the layer in the other (on the CPU path, where nothing needs copying, the arena's
views themselves); the head (and a tied head's table) whole, into a device tensor of its own, started early where
its weights are current and handed to compute when the head runs. A resident unit (megatrain/engine/resident.py)
takes no buffer: its weights are bound where they live on the device; unless they are cast at each use (no bf16 copy
kept), when they are cast into a buffer on the compute stream (after the unit's last update there), as a streamed
unit's copy lands in one."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.engine.resident import ResidentUnits
from megatrain.engine.streams import Streams
from megatrain.memory.buffers import WEIGHT_BUFFERS, WEIGHT_STAGING, dtype_name, has, row, weight_buffers
from megatrain.model.layout import Unit
from megatrain.telemetry import Recorder


class WeightSlots:
    """Two device buffers that decoder layers rotate through; a unit stays resident until evicted, so the
    top two layers of the forward are reused by the backward without a second copy."""

    def __init__(self, numel: int, weights: torch.Tensor, streams: Streams, dtype: torch.dtype, rec: Recorder,
                 resident: ResidentUnits | None = None):
        self.weights, self.streams, self.dtype, self.rec = weights, streams, dtype, rec  # weights: host, flat
        self.resident_units = resident
        self.copy_needed = streams.asynchronous or dtype != weights.dtype
        n = 2 if self.copy_needed or (resident is not None and resident.cast) else 0
        dev = streams.device
        # bf16 compute from fp32 weights on a GPU (or fp32 compute from a LoRA run's bf16 base): they arrive in a
        # staging buffer in their own dtype and are cast there; the rows the memory plan sums (buffers.py)
        table = weight_buffers(numel, 0, dtype_name(dtype), dtype_name(weights.dtype), streams.asynchronous)
        self.staging = row(table, WEIGHT_STAGING).allocate(dev) if n and has(table, WEIGHT_STAGING) else []
        self.buffers = row(table, WEIGHT_BUFFERS).allocate(dev) if n else []
        self.resident: list[int | None] = [None] * n
        self.ready: list[Any] = [None] * n
        self.free: list[Any] = [None] * n
        self.whole: dict[int, tuple[torch.Tensor, Any]] = {}  # unit -> (its weights on the device, copied after)

    def fetch(self, unit: Unit, keep: Unit | None) -> None:
        """Starts bringing `unit` in, into the buffer that does not hold `keep` (the layer computing now)."""
        cast = self._cast(unit)
        if unit.index in self.resident or not (cast or (self.copy_needed and not self._on_device(unit))):
            return
        slot = next(i for i, r in enumerate(self.resident) if keep is None or r != keep.index)
        s = self.streams
        if cast:  # by compute (this thread, its stream): after the unit's update there and the buffer's last reader
            s.wait(s.compute, self.ready[slot])  # and after the copy that filled the buffer last, were it landing
            with self.rec.span("compute", "cast", unit.index, s.compute):
                self.buffers[slot][: unit.numel].copy_(self.resident_units.weights_of(unit))  # type: ignore[union-attr]
            self.ready[slot], self.resident[slot] = None, unit.index
            return
        src = unit.range_of(self.weights)
        s.wait(s.h2d, self.free[slot])  # before the span: waiting for compute to free the buffer is not copying
        with self.rec.span("h2d", "load", unit.index, s.h2d, src.numel() * src.element_size()):
            if self.staging:
                s.copy(self.staging[slot][: unit.numel], src, s.h2d)
                s.copy(self.buffers[slot][: unit.numel], self.staging[slot][: unit.numel], s.h2d)
            else:
                s.copy(self.buffers[slot][: unit.numel], src, s.h2d)
        self.ready[slot] = s.record(s.h2d)
        self.resident[slot] = unit.index

    def acquire(self, unit: Unit) -> tuple[int, dict[str, torch.Tensor]]:
        """Makes the compute stream wait for `unit`'s weights and binds them."""
        if self._on_device(unit) and not self._cast(unit):
            w = self.resident_units.weights_of(unit)  # type: ignore[union-attr]
            self.streams.compute_uses(w)
            return -1, unit.bind(w)
        if not self.copy_needed and not self._cast(unit):
            return -1, unit.bind(unit.range_of(self.weights))
        slot = self.resident.index(unit.index)
        self.streams.wait(self.streams.compute, self.ready[slot])
        self.streams.compute_uses(self.buffers[slot])
        return slot, unit.bind(self.buffers[slot][: unit.numel])

    def fetch_whole(self, unit: Unit) -> None:
        """Starts bringing `unit` in whole (the head, a tied head's table: they take no buffer), into a device tensor of
        its own that `take_whole` hands to compute; compute waits for the copy only then."""
        if not self.copy_needed or unit.index in self.whole or self._on_device(unit):
            return
        src, s = unit.range_of(self.weights), self.streams
        with self.rec.span("h2d", "load", unit.index, s.h2d, src.numel() * src.element_size()):
            weights = s.to_device(src, s.h2d)
        self.whole[unit.index] = weights, s.record(s.h2d)

    def take_whole(self, unit: Unit) -> torch.Tensor:
        """`unit`'s weights on the device in the compute dtype, flat, compute ordered after their copy (started now
        where `fetch_whole` did not start it)."""
        if self._on_device(unit):  # cast here where its weights are cast at each use (else already the dtype)
            return self.resident_units.weights_of(unit).to(self.dtype)  # type: ignore[union-attr]
        if not self.copy_needed:
            return unit.range_of(self.weights)
        self.fetch_whole(unit)
        weights, ready = self.whole.pop(unit.index)
        self.streams.wait(self.streams.compute, ready)
        self.streams.compute_uses(weights)
        return weights.to(self.dtype)

    def _on_device(self, unit: Unit) -> bool:
        return self.resident_units is not None and self.resident_units.holds(unit)

    def _cast(self, unit: Unit) -> bool:
        """`unit` is resident and its weights are cast into a buffer at each use."""
        return self._on_device(unit) and self.resident_units.cast  # type: ignore[union-attr]

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.free[slot] = self.streams.record(self.streams.compute)

    def invalidate(self) -> None:
        """Forgets what is resident, and any whole unit fetched and not taken (a failed step's): the optimizer may
        have rewritten the arena since."""
        self.resident = [None] * len(self.resident)
        self.whole.clear()

