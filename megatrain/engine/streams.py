"""Streams and events: three CUDA streams on a GPU, and the same calls as immediate no-ops on the CPU.

The executor is written once against this interface; on the CPU path every copy has already happened
when the call returns, so there is nothing to order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.compute = torch.cuda.current_stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.compute = self.d2h = None

    def record(self, stream: torch.cuda.Stream | None, blocking: bool = False) -> torch.cuda.Event | None:
        """An event at the current end of `stream`. blocking: for a host thread to wait on; such a thread sleeps
        instead of spinning a core the optimizer workers could use."""
        if stream is None:
            return None
        event = torch.cuda.Event(blocking=blocking)
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
