"""Host buffers the executor keeps from step to step, by name: page-locked on a GPU, grown when a batch needs
more; and a device scalar's way to the host that waits for it alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatrain.engine.streams import Streams


class HostBuffers:
    """Named [rows, cols] host buffers (the gathered embedding rows, their gradient rows): page-locked blocks
    allocated per step would stay cached by torch's host allocator, so each is kept and only ever grown."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] view of buffer `name` (a new one where the kept one is too small or of another shape)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype:
            buf = self._buffers[name] = self.streams.pinned(rows, cols, dtype=dtype)
        return buf[:rows]

    def read_later(self, name: str, value: torch.Tensor) -> Callable[[], float]:
        """Queues the copy of device scalar `value`, just computed on the compute stream, into buffer `name` on
        the D2H stream; returns what reads it, waiting for that copy alone: float(value) would wait for every
        kernel queued on compute since (and, read before more is queued, leave the device idle meanwhile)."""
        s = self.streams
        host = self.get(name, 1, 1, value.dtype)[0, 0]
        s.wait(s.d2h, s.record(s.compute))
        s.copy(host, value, s.d2h)
        landed = s.record(s.d2h, blocking=True)

        def read() -> float:
            if landed is not None:
                landed.synchronize()
            return float(host)

        return read
