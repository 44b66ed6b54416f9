"""Activation checkpoints: the layer inputs the backward recomputes from, held on the device up to a byte budget
(device checkpoints), the rest offloaded to page-locked host memory (offloaded checkpoints) and brought back one
layer ahead of the backward. Their accounting is what the memory plan is checked against
(docs/design.md#activation-checkpoints)."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.config import MegatrainError
from megatrain.engine.streams import Streams
from megatrain.memory.buffers import device_checkpoints


class ActivationCheckpoints:
    """One step's layer inputs, put by the forward and got by the backward, top first."""

    def __init__(self, streams: Streams, budget: int | None = None):
        """budget: bytes of device memory for device checkpoints (None: every checkpoint stays on the device; 0:
        every one goes to the host)."""
        if budget is not None and budget < 0:
            raise MegatrainError(f"the checkpoint budget must be a non-negative number of bytes, got {budget}.")
        self.streams, self.budget = streams, budget
        self._host: dict[int, torch.Tensor] = {}  # layer -> its page-locked buffer, reused from step to step
        self._host_read: dict[int, Any] = {}  # layer -> event after the last H2D read of its buffer
        self.device_bytes = self.transfer_bytes = 0
        self.peak_device_bytes = self.peak_transfer_bytes = 0
        self.offloaded = 0  # checkpoints copied to the host, all steps

    @property
    def host_bytes(self) -> int:
        """Bytes of the page-locked buffers offloaded checkpoints land in (reused from step to step): what the memory
        plan's host_checkpoints predicts."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

    def begin(self, num_layers: int) -> None:
        """A step of `num_layers` checkpoints (anything left of the previous step is dropped, and the host buffers
        of checkpoints past them: a step with fewer micro-batches than the last keeps no memory for the others)."""
        for index in [i for i in self._host if i >= num_layers]:
            del self._host[index]
            self._host_read.pop(index, None)
        self._device: dict[int, torch.Tensor] = {}
        self._on_host: dict[int, Any] = {}  # layer -> event after its D2H copy
        self._incoming: dict[int, tuple[torch.Tensor, Any]] = {}
        self._outgoing: tuple[torch.Tensor, Any] | None = None
        self._num_layers = num_layers
        self._first_on_device: int | None = None  # decided at the first put, from the checkpoint size
        self.device_bytes = self.transfer_bytes = 0

    def put(self, index: int, x: torch.Tensor) -> None:
        size = x.numel() * x.element_size()
        if self._first_on_device is None:
            self._first_on_device = self._num_layers - device_checkpoints(self._num_layers, self.budget, size)
        if index >= self._first_on_device:
            self._device[index] = x
            self._count("device", size)
            return
        s = self.streams
        self._land_outgoing()  # one copy out at a time: its device tensor is freed before the next one is made
        host = self._host.get(index)
        if host is None or host.shape != x.shape or host.dtype != x.dtype:
            host = self._host[index] = s.pinned(*x.shape, dtype=x.dtype)
            self._host_read.pop(index, None)
        s.wait(s.d2h, self._host_read.pop(index, None))  # last step's read of the buffer is done
        s.wait(s.d2h, s.record(s.compute))  # x is written by compute
        s.copy(host, x, s.d2h)
        event = s.record(s.d2h, blocking=True)
        self._on_host[index] = event
        self._outgoing = (x, event)
        self._count("transfer", size)
        self.offloaded += 1

    def get(self, index: int) -> torch.Tensor:
        """Layer `index`'s input on the device, ready for compute; starts bringing the next one down."""
        if index in self._device:
            x = self._device.pop(index)
            self._count("device", -x.numel() * x.element_size())
        else:
            self._land_outgoing()
            self.prefetch(index)
            x, event = self._incoming.pop(index)
            self.streams.wait(self.streams.compute, event)
            self.streams.compute_uses(x)
            self._count("transfer", -x.numel() * x.element_size())
        self.prefetch(index - 1)
        return x

    def prefetch(self, index: int) -> None:
        """Starts the H2D copy of a host-resident checkpoint (nothing for one on the device or already coming)."""
        if index < 0 or index not in self._on_host or index in self._incoming:
            return
        s, host = self.streams, self._host[index]
        s.wait(s.h2d, self._on_host.pop(index))
        x = s.to_device(host, s.h2d)
        self._host_read[index] = s.record(s.h2d)
        self._incoming[index] = (x, s.record(s.h2d))
        self._count("transfer", x.numel() * x.element_size())

    def _land_outgoing(self) -> None:
        if self._outgoing is None:
            return
        x, event = self._outgoing
        if event is not None:
            event.synchronize()
        self._outgoing = None
        self._count("transfer", -x.numel() * x.element_size())

    def _count(self, kind: str, nbytes: int) -> None:
        if kind == "device":
            self.device_bytes += nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        else:
            self.transfer_bytes += nbytes
            self.peak_transfer_bytes = max(self.peak_transfer_bytes, self.transfer_bytes)

    def end(self) -> None:
        """The step is over (or failed): nothing of it stays on the device."""
        self._land_outgoing()
        self._device.clear()
        self._incoming.clear()
        self.device_bytes = self.transfer_bytes = 0
