"""Streams and events in three modes, one interface for the executor:

    cuda       three CUDA streams (H2D, compute, D2H); copies are asynchronous, ordered by events
    cpu        every call is immediate: a copy has happened when it returns, so there is nothing to order
    cpu-async  the CPU with the GPU's asynchrony simulated, so that a missing wait fails a test on a CPU

The simulation's checks (poison, compute reads, copy hazards): docs/design.md#streams."""

from __future__ import annotations

import queue
import random
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from megatrain.config import ConfigError, MegatrainError, check_device


class StreamOrderError(MegatrainError):
    """A simulated stream ordering a GPU would not guarantee: a missing wait on an event."""


SIMULATED = re.compile(r"cpu-async(?::(\d+))?")


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a device string computes on ("auto": a visible GPU, else the CPU)."""
    name = str(device)
    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if SIMULATED.fullmatch(name):
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no CUDA GPU is visible; use device='cpu' or 'auto'.")
    return dev


def make_streams(device: str | torch.device) -> Streams:
    """The streams for a device string: "cpu-async[:SEED]" simulates (SEED: the delays' seed, default 0)."""
    if (m := SIMULATED.fullmatch(str(device))) is not None:
        return SimulatedStreams(seed=int(m.group(1) or 0))
    dev = resolve_device(device)
    return CudaStreams(dev) if dev.type == "cuda" else Streams()


class Streams:
    """The CPU path: one thread, every copy done when the call returns."""

    cuda = False
    asynchronous = False  # copies may still be in flight when the call returns (cuda, cpu-async)

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.h2d: Any = None
        self.compute: Any = None
        self.d2h: Any = None

    def record(self, stream: Any, blocking: bool = False) -> Any:
        """An event at the current end of `stream` (None where there is nothing to wait for). blocking: a host
        thread will wait on it; on a GPU it then sleeps instead of spinning a core the optimizer could use."""
        return None

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on `stream` from now on runs after `event` (on compute: the calling thread waits)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """dst <- src on `stream` (casting to dst's dtype)."""
        dst.copy_(src)

    def to_device(self, t: torch.Tensor, stream: Any) -> torch.Tensor:
        """A device copy of host tensor `t`, queued on `stream` (t itself where host and device are one)."""
        return t

    def poison(self, t: torch.Tensor) -> None:
        """Marks `t` as about to be refilled by a copy (the simulation fills it with NaN)."""

    def compute_uses(self, *tensors: torch.Tensor) -> None:
        """Compute is about to read (or has just written) `tensors` (the simulation checks and remembers it)."""

    def pinned(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host tensor a copy stream may read or write asynchronously (page-locked on a GPU)."""
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        """Waits until every stream has run everything queued on it."""

    def close(self) -> None:
        pass


class CudaStreams(Streams):
    cuda = True
    asynchronous = True

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
        self.d2h = torch.cuda.Stream(device)

    def record(self, stream: torch.cuda.Stream, blocking: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(blocking=blocking)
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
        if event is not None:
            stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            if src.is_cuda:
                # allocated on another stream and read on this one: without it the allocator could hand the
                # block out again as soon as the caller drops it, while this copy still reads it
                src.record_stream(stream)
                if src.dtype != dst.dtype and not dst.is_cuda:
                    src = src.to(dst.dtype)  # out of the device: cast there (allocated on this stream), then copy
            dst.copy_(src, non_blocking=True)

    def to_device(self, t: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        with torch.cuda.stream(stream):
            out = (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)
        # allocated on `stream`, read on compute: without it the allocator could hand the block to the next copy
        # on `stream` as soon as the caller drops it, while compute still reads it
        out.record_stream(self.compute)
        return out

    def pinned(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


# ---- the simulation ----

SIM_MAX_DELAY_S = 0.002  # a copy or a compute event runs up to this late: long beside a tiny model's layer
SIM_EVENT_TIMEOUT_S = 120.0  # a host wait longer than this is a simulated deadlock, reported instead of hanging


class SimEvent:
    """An event of a simulated stream: set once the work queued before it has run."""

    def __init__(self, stream: SimStream):
        self.stream = stream
        self.seq = 0  # operations queued on `stream` up to and including this event
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(SIM_EVENT_TIMEOUT_S):
            raise StreamOrderError(f"an event on the simulated {self.stream.name} stream was not reached in "
                                   f"{SIM_EVENT_TIMEOUT_S:g} s: its stream waits for something that never comes.")
        self.stream.raise_error()


class SimStream:
    """A queue of operations run in order by a worker thread, each after a random delay."""

    def __init__(self, name: str, seed: int, max_delay: float):
        self.name = name
        self.queued = 0  # operations queued so far
        self.waited_compute = 0  # the latest compute event this stream's queued work runs after (by seq)
        self.error: BaseException | None = None
        self._rng = random.Random(seed)
        self._max_delay = max_delay
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        self.queued += 1
        self._queue.put(op)

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            time.sleep(self._rng.uniform(0.0, self._max_delay))
            try:
                if self.error is None:  # after a failure only events are set (as a broken CUDA stream would)
                    op()
            except BaseException as e:  # raised to the host at its next wait on this stream
                self.error = e
            finally:
                if isinstance(op, _SetEvent):
                    op.event._done.set()
            del op

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._queue.put(None)  # the worker ends once what was queued before has run


class _SetEvent:
    def __init__(self, event: SimEvent):
        self.event = event

    def __call__(self) -> None:
        pass  # SimStream._run sets it, failure or not


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _remember(table: dict[int, tuple], t: torch.Tensor, entry: Callable[[weakref.ref], tuple]) -> None:
    """table[storage of t] = entry(weak reference to that storage), forgotten once the storage is freed (its
    memory may be reused). The storage, not t: t may be a view that dies at once while its buffer lives on."""
    storage = t.untyped_storage()
    key = storage.data_ptr()

    def forget(ref: weakref.ref) -> None:
        if (held := table.get(key)) is not None and held[-1] is ref:
            table.pop(key, None)

    table[key] = entry(weakref.ref(storage, forget))


def _stop(streams: list[SimStream]) -> None:
    for stream in streams:
        stream.stop()


class SimulatedStreams(Streams):
    """The CPU with CUDA's asynchrony simulated; see docs/design.md#streams."""

    asynchronous = True

    def __init__(self, seed: int = 0, max_delay: float = SIM_MAX_DELAY_S):
        super().__init__()
        self.seed = seed
        self.h2d = SimStream("h2d", seed * 3 + 1, max_delay)
        self.compute = SimStream("compute", seed * 3 + 2, max_delay)  # sets compute's events late, in order
        self.d2h = SimStream("d2h", seed * 3 + 3, max_delay)
        self._lock = threading.Lock()  # the executor queues copies from two threads (the step, the sender)
        self._compute_waited: dict[str, int] = {"h2d": 0, "d2h": 0}  # per copy stream, seq compute waited for
        self._last_copy: dict[int, tuple[SimStream, int, weakref.ref]] = {}  # storage -> the last copy into it
        self._compute_use: dict[int, tuple[int, weakref.ref]] = {}  # storage -> compute's clock at its last use
        # the worker threads end with this object (an executor dropped without close)
        self._finalizer = weakref.finalize(self, _stop, [self.h2d, self.compute, self.d2h])

    def record(self, stream: SimStream, blocking: bool = False) -> SimEvent:
        with self._lock:
            event = SimEvent(stream)
            stream.submit(_SetEvent(event))
            event.seq = stream.queued
            return event

    def wait(self, stream: SimStream, event: SimEvent | None) -> None:
        if event is None:
            return
        if stream is self.compute:  # the compute stream is the calling thread
            event.synchronize()
            with self._lock:
                if event.stream is not self.compute:
                    self._compute_waited[event.stream.name] = max(self._compute_waited[event.stream.name], event.seq)
            return
        with self._lock:
            if event.stream is self.compute:
                stream.waited_compute = max(stream.waited_compute, event.seq)
            stream.submit(event.synchronize)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        with self._lock:
            for t, role, risk in ((src, "reads", "read it before compute wrote it"),
                                  (dst, "writes", "overwrite it while compute reads it")):
                use = self._compute_use.get(_storage(t))
                if use is not None and use[1]() is not None and stream.waited_compute <= use[0]:
                    raise StreamOrderError(f"a copy on the {stream.name} stream {role} a tensor compute used without "
                                           "waiting for a compute event recorded after that use (a missing "
                                           f"wait_event): on a GPU it could {risk}.")
            self.poison(dst)
            stream.submit(lambda: dst.copy_(src))
            _remember(self._last_copy, dst, lambda ref: (stream, stream.queued, ref))

    def to_device(self, t: torch.Tensor, stream: SimStream) -> torch.Tensor:
        out = torch.empty_like(t)
        self.copy(out, t, stream)
        return out

    def poison(self, t: torch.Tensor) -> None:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)  # an id no table has: indexing with it fails

    def compute_uses(self, *tensors: torch.Tensor) -> None:
        with self._lock:
            clock = self.compute.queued
            for t in tensors:
                key = _storage(t)
                copy = self._last_copy.get(key)
                if copy is not None and copy[2]() is not None and self._compute_waited[copy[0].name] < copy[1]:
                    raise StreamOrderError(f"compute used a tensor before waiting for the {copy[0].name} copy into "
                                           "it (a missing wait_event): on a GPU it could read what was there before.")
                _remember(self._compute_use, t, lambda ref, clock=clock: (clock, ref))

    def synchronize(self) -> None:
        for stream in (self.h2d, self.compute, self.d2h):
            self.record(stream).synchronize()

    def close(self) -> None:
        self._finalizer()
