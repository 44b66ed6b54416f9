"""Per-layer spans and the stall accounting of one training step.

A `Recorder` collects `Span`s on named lanes (the three streams, host work, the host's waits, the gradient sender's,
the handouts, the optimizer workers'), all on time.monotonic(), one clock for every process on the machine. CUDA
events are read once, at `end_step` (docs/design.md#spans)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import torch

DEVICE_LANES = ("h2d", "compute", "d2h")
WAIT_LANE = "wait"
WAIT_CAUSES = ("weights", "optimizer", "gradients", "data")
# The gradient sender thread (megatrain/engine/grad_egress.py) waiting for the optimizer to free the host slot its
# next unit goes to: not a cause by itself (that thread is not compute), it says why compute waits for gradients.
EGRESS_LANE = "grads-out"
# The executor handing a unit's update to the optimizer pool as its gradient lands (clipping off, or beside the
# backward): the gap to the workers' update spans is the pool's queueing, which their processes' scheduling decides.
HANDOUT_LANE = "handout"
STEP_LANE = "step"  # one span per step: its window, so a trace alone knows where steps begin and end


def optimizer_lane(worker: int, node: int = 0) -> str:
    """Worker `worker`'s lane; another node's workers' lanes carry their node (the first node's names stay)."""
    return f"optimizer/{worker}" if node == 0 else f"node {node}/optimizer/{worker}"


def executor_lanes(spans: list[Span], rank: int, per_node: int) -> list[Span]:
    """The spans of executor `rank` (of several): the first's lanes keep their names (its stall table is the step's
    in the report), each other's are its own lanes (`executor 1/compute`; `node 1/executor 0/compute` with several
    nodes), so the timeline shows every executor's stalls."""
    if rank == 0:
        return spans
    node, local = divmod(rank, per_node)
    prefix = f"node {node}/executor {local}/" if rank >= per_node else f"executor {rank}/"
    return [Span(prefix + s.lane, s.name, s.step, s.start, s.end, s.layer, s.nbytes) for s in spans]


@dataclass(slots=True)
class Span:
    lane: str
    name: str
    step: int
    start: float  # seconds, time.monotonic() base
    end: float
    layer: int | None = None
    nbytes: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class StepStats:
    """Where one step's time went: compute + wait_weights + wait_optimizer + wait_gradients + wait_data + other
    == step_time (see `account` for how idle time is attributed)."""

    step: int
    step_time: float  # seconds, begin_step -> end_step
    compute: float  # union of the compute lane's spans
    wait_weights: float  # compute idle while weights were on their way in (or the host waited for them)
    wait_optimizer: float  # compute idle while the host waited for the optimizer to finish a layer
    wait_data: float  # compute idle while the host (or the driver, before the step) waited for a batch
    other: float  # compute idle for none of the above: host overhead, launch latency, gradient copies
    h2d_bytes: int
    d2h_bytes: int
    h2d_gbps: float  # bytes over the time the h2d lane was busy (10^9 B/s)
    d2h_gbps: float
    overlap: float  # fraction of transfer time (h2d or d2h busy) hidden under compute
    stall_fraction: float  # 1 - compute / step_time
    start: float = 0.0  # monotonic seconds of begin_step, to find the step in a trace
    # compute idle while the host waited for earlier units' gradients to leave the device (last: records written
    # before it existed read as 0)
    wait_gradients: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepStats:
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in d and f.name not in ("start", "wait_gradients")]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


# ---- stall accounting ----

# Flags a span can raise while it runs; a span may raise several (an h2d copy is both a weights cause
# and a transfer).
_COMPUTE, _DATA, _OPTIMIZER, _GRADIENTS, _WEIGHTS, _TRANSFER, _H2D, _D2H, _SLOT = range(9)
_CAUSES = (_COMPUTE, _DATA, _OPTIMIZER, _GRADIENTS, _WEIGHTS)  # in the order they claim an instant


def _flags(span: Span) -> tuple[int, ...]:
    if span.lane == "compute":
        return (_COMPUTE,)
    if span.lane == "h2d":
        return (_WEIGHTS, _TRANSFER, _H2D)
    if span.lane == "d2h":
        return (_TRANSFER, _D2H)
    if span.lane == WAIT_LANE:
        return {"data": (_DATA,), "optimizer": (_OPTIMIZER,), "gradients": (_GRADIENTS,),
                "weights": (_WEIGHTS,)}.get(span.name, ())
    if span.lane == EGRESS_LANE:
        return (_SLOT,)
    return ()  # host work, optimizer updates, step markers: context, not causes


def _events(spans: Iterable[Span], start: float, end: float) -> tuple[list[tuple[float, int, int]], int, int]:
    """The spans clipped to the window as (time, flag, +1 at a start / -1 at an end), sorted; the bytes copied."""
    events: list[tuple[float, int, int]] = []
    h2d_bytes = d2h_bytes = 0
    for s in spans:
        a, b = max(s.start, start), min(s.end, end)
        if b <= a:
            continue
        for flag in _flags(s):
            events += [(a, flag, 1), (b, flag, -1)]
        if s.lane == "h2d":
            h2d_bytes += s.nbytes
        elif s.lane == "d2h":
            d2h_bytes += s.nbytes
    events.sort(key=lambda e: e[0])
    return events, h2d_bytes, d2h_bytes


def _sweep(events: list[tuple[float, int, int]], start: float, end: float) -> tuple[list[float], float]:
    """(time attributed to each cause, and busy time of each transfer flag; transfer time under compute)."""
    active = [0] * 9
    total = [0.0] * 9
    hidden = 0.0
    t_prev = start
    for t, flag, delta in events + [(end, -1, 0)]:
        dt = t - t_prev
        if dt > 0:
            for cause in _CAUSES:
                if active[cause]:
                    total[_OPTIMIZER if cause == _GRADIENTS and active[_SLOT] else cause] += dt
                    break
            for busy in (_TRANSFER, _H2D, _D2H):
                if active[busy]:
                    total[busy] += dt
            if active[_COMPUTE] and active[_TRANSFER]:
                hidden += dt
            t_prev = t
        if flag >= 0:
            active[flag] += delta
    return total, hidden


def account(spans: Iterable[Span], step: int, start: float, end: float) -> StepStats:
    """Splits the window [start, end] into compute and the causes of the compute lane's gaps.

    The rule, applied to every instant of the window that the compute lane is idle (in this order):
      1. "data"      if the host is waiting for a batch (a wait span named "data") at that instant;
      2. "optimizer" else if the host is waiting for the optimizer (a wait span named "optimizer");
      3. "gradients" else if the host is waiting for earlier units' gradients to leave the device (a wait span
                     named "gradients": GRAD_SETS_IN_FLIGHT sets on their way out) -- counted as "optimizer"
                     instead while the gradient sender thread waits for the optimizer to free a host slot
                     (a span on EGRESS_LANE): then the copies are held up by the optimizer, not the link;
      4. "weights"   else if an h2d copy is running, or the host waits for weights (wait "weights"):
                     the compute stream is waiting for the next layer's weights;
      5. "other"     else: host overhead, kernel-launch latency, gradient copies on the CPU path.
    Instants rather than whole gaps, so a 10 µs wait for a batch that was already there does not claim
    the 15 ms weight copy that follows it in the same gap. Spans are clipped to the window; "other" is
    computed as the remainder, so the parts add up to step_time exactly.
    """
    events, h2d_bytes, d2h_bytes = _events(spans, start, end)
    total, hidden = _sweep(events, start, end)
    step_time = end - start
    compute, data, optimizer, weights = total[_COMPUTE], total[_DATA], total[_OPTIMIZER], total[_WEIGHTS]
    gradients = total[_GRADIENTS]
    return StepStats(
        step=step, step_time=step_time, compute=compute, wait_weights=weights, wait_optimizer=optimizer,
        wait_gradients=gradients, wait_data=data, other=step_time - (compute + weights + optimizer + gradients + data),
        h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes,
        h2d_gbps=h2d_bytes / total[_H2D] / 1e9 if total[_H2D] > 0 else 0.0,
        d2h_gbps=d2h_bytes / total[_D2H] / 1e9 if total[_D2H] > 0 else 0.0,
        overlap=hidden / total[_TRANSFER] if total[_TRANSFER] > 0 else 0.0,
        stall_fraction=1.0 - compute / step_time if step_time > 0 else 0.0,
        start=start,
    )


def add_wait_before(stats: dict, spans: list[Span], wait: Span) -> None:
    """Puts a wait that came before the step's window into the step's accounting, in place: the driver's wait for
    the step's batch (cause wait.name), timed in its own process before the executor began the step. The window
    grows by the wait's duration at its start, where the wait is put (the time between the two, handing the step to
    the executor, stays out of the window as it always was); the parts still add up to step_time. `spans`: the
    step's trace spans (empty when not tracing), where the step's window grows the same way and the wait joins it.
    """
    lead = wait.duration
    stats["start"] -= lead
    stats["step_time"] += lead
    stats[f"wait_{wait.name}"] += lead
    stats["stall_fraction"] = 1.0 - stats["compute"] / stats["step_time"] if stats["step_time"] > 0 else 0.0
    if not spans:
        return
    for i, s in enumerate(spans):
        if s.lane == STEP_LANE and s.step == wait.step:
            spans[i] = Span(STEP_LANE, s.name, s.step, s.start - lead, s.end)
    spans.append(Span(wait.lane, wait.name, wait.step, stats["start"], stats["start"] + lead))


# ---- the recorder ----

class _HostSpan:
    """Times a block on the host clock; a class rather than @contextmanager: it runs per layer."""

    __slots__ = ("rec", "span")

    def __init__(self, rec: Recorder, span: Span):
        self.rec, self.span = rec, span

    def __enter__(self) -> Span:
        self.span.start = time.monotonic()
        return self.span

    def __exit__(self, *exc: object) -> None:
        self.span.end = time.monotonic()
        with self.rec._lock:
            self.rec._pending.append(self.span)


class _DeviceSpan:
    """Records a start and an end CUDA event on `stream` around the block; read in end_step."""

    __slots__ = ("rec", "span", "stream", "start")

    def __init__(self, rec: Recorder, span: Span, stream: torch.cuda.Stream):
        self.rec, self.span, self.stream = rec, span, stream

    def __enter__(self) -> Span:
        self.start = self.rec._event()
        self.start.record(self.stream)
        return self.span

    def __exit__(self, *exc: object) -> None:
        end = self.rec._event()
        end.record(self.stream)
        with self.rec._lock:
            self.rec._device_pending.append((self.span, self.start, end, self.stream))


_NULL = contextlib.nullcontext()  # what a disabled recorder hands out: no allocation, no clock read


class Recorder:
    """Collects one process's spans step by step and does the stall accounting at each end_step.

    Put stream.wait_event(...) calls *before* a device span, not inside it: a span measures from when its
    stream reaches the start event, so a wait inside is counted as the work's own time.
    keep_steps bounds memory on long runs: spans of steps older than the last keep_steps are dropped at
    end_step (None keeps everything).

    Spans may come from several threads (the executor sends gradients out on threads of its own, one of
    which may still be copying the last step's while the next step runs): a span still running when a step
    ends is kept for the next one.
    """

    def __init__(self, enabled: bool = True, keep_steps: int | None = 32):
        self.enabled = enabled
        self.keep_steps = keep_steps
        self.spans: list[Span] = []
        self.step = -1
        self._t0: float | None = None
        self._device: torch.device = torch.device("cpu")
        self._begin_event: torch.cuda.Event | None = None
        self._pending: list[Span] = []
        self._device_pending: list[tuple[Span, torch.cuda.Event, torch.cuda.Event, torch.cuda.Stream]] = []
        self._free_events: list[torch.cuda.Event] = []
        self._lock = threading.Lock()

    def _event(self) -> torch.cuda.Event:
        with self._lock:
            if self._free_events:
                return self._free_events.pop()
        return torch.cuda.Event(enable_timing=True)

    def begin_step(self, step: int, device: torch.device | str = "cpu") -> None:
        self.step = step
        self._device = torch.device(device)
        self._t0 = time.monotonic()
        if self.enabled and self._device.type == "cuda":
            self._begin_event = self._event()
            self._begin_event.record(torch.cuda.current_stream(self._device))

    def span(self, lane: str, name: str, layer: int | None = None, stream: torch.cuda.Stream | None = None,
             nbytes: int = 0) -> contextlib.AbstractContextManager:
        """Times the block as work `name` on `lane`: on `stream`'s timeline if it is a CUDA stream, else
        on the host clock (the CPU path, where the block does the work before it returns)."""
        if not self.enabled:
            return _NULL
        s = Span(lane, name, self.step, 0.0, 0.0, layer, nbytes)
        if stream is not None and isinstance(stream, torch.cuda.Stream):
            return _DeviceSpan(self, s, stream)
        return _HostSpan(self, s)

    def wait(self, cause: str, layer: int | None = None) -> contextlib.AbstractContextManager:
        """Times the host blocked on `cause` (one of WAIT_CAUSES)."""
        if cause not in WAIT_CAUSES:
            raise ValueError(f"wait cause must be one of {WAIT_CAUSES}, got {cause!r}")
        if not self.enabled:
            return _NULL
        return _HostSpan(self, Span(WAIT_LANE, cause, self.step, 0.0, 0.0, layer))

    def add_span(self, span: Span) -> None:
        """A span measured elsewhere (an optimizer worker's update); kept for the trace only."""
        if self.enabled:
            self.spans.append(span)

    def end_step(self, keep: bool = True) -> StepStats:
        """The step's stall accounting. keep=False: its spans are dropped rather than kept for the trace (an
        evaluation between training steps, whose spans would otherwise be counted in the next step)."""
        if self._t0 is None:
            raise RuntimeError("end_step() called without begin_step()")
        if not self.enabled:  # the step time is still worth having; everything else is unknown
            start, self._t0 = self._t0, None
            t = time.monotonic() - start
            return StepStats(self.step, t, 0.0, 0.0, 0.0, 0.0, t, 0, 0, 0.0, 0.0, 0.0, 1.0, start, 0.0)
        if self._device.type == "cuda" or self._device_pending:
            end = self._resolve_device_spans()
        else:
            end = time.monotonic()
        start, self._t0 = self._t0, None
        with self._lock:
            step_spans, self._pending = self._pending, []
        stats = account(step_spans, self.step, start, end)
        if not keep:
            return stats
        step_spans.append(Span(STEP_LANE, "step", self.step, start, end))
        self.spans.extend(step_spans)
        if self.keep_steps is not None:
            oldest = self.step - self.keep_steps + 1
            if self.spans and self.spans[0].step < oldest:
                self.spans = [s for s in self.spans if s.step >= oldest]
        return stats

    def _resolve_device_spans(self) -> float:
        """Waits (once) for the spanned streams and puts every pending event on the host clock.

        An anchor event on the current stream, made to follow the last work of every spanned stream, is the
        only thing the host waits for; once it has completed the device is at most the wake-up latency
        (microseconds) behind the host clock, and every event's time is read relative to it.
        """
        device = self._device if self._device.type == "cuda" else torch.device("cuda")
        current = torch.cuda.current_stream(device)
        tails_of: list[torch.cuda.Stream] = []  # streams other than the current one that carry spans
        tails: list[torch.cuda.Event] = []
        with self._lock:
            pending, self._device_pending = self._device_pending, []
        for _, _, _, stream in pending:
            if stream != current and not any(stream == t for t in tails_of):
                tails_of.append(stream)
                tails.append(self._event())
                tails[-1].record(stream)
                current.wait_event(tails[-1])
        anchor = self._event()
        anchor.record(current)
        anchor.synchronize()
        t_anchor = time.monotonic()
        with self._lock:
            self._free_events += tails

        def host_time(ev: torch.cuda.Event) -> float:
            return t_anchor - ev.elapsed_time(anchor) / 1e3

        # The device cannot run the step's first event before the host asked for it; if the anchor reads
        # it earlier, the device clock drifted from the host's over the step: shift the step's spans.
        shift = 0.0
        done: list[torch.cuda.Event] = [anchor]
        if self._begin_event is not None:
            shift = max(0.0, self._t0 - host_time(self._begin_event))
            done.append(self._begin_event)
            self._begin_event = None
        resolved, unfinished = [], []
        for entry in pending:
            span, ev_start, ev_end, _ = entry
            if not ev_end.query():  # recorded by another thread after the tails: the next step reads it
                unfinished.append(entry)
                continue
            span.start, span.end = host_time(ev_start) + shift, host_time(ev_end) + shift
            resolved.append(span)
            done += [ev_start, ev_end]
        with self._lock:
            self._pending += resolved
            self._device_pending[:0] = unfinished
            self._free_events += done
        return t_anchor
