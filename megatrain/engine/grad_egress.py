"""Gradient egress: each unit's gradients from the device into its range of the host `grads` segment, in order.

Sending a GradsOut is a small state machine (wait for the host slot, queue the copies; wait for them to land, call
`landed`, release the device side), run on a thread of its own on a GPU so that compute never waits on a slot or a
copy. It knows nothing of the schedule (docs/design.md#gradient-egress)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain.config import MegatrainError
from megatrain.engine.streams import Streams
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, GradLayout, Unit
from megatrain.telemetry import EGRESS_LANE, Recorder

UnitCallback = Callable[[Unit], None]
LandedCallback = Callable[[Unit, float], None]  # (unit, squared norm of its gradient)


def noop(unit: Unit, *args: object) -> None:
    """The callback for a caller with nothing to do when a unit's weights are read or its gradients land."""


@dataclass
class GradsOut:
    """One unit's gradients on their way from the device to the host grads segment."""

    unit: Unit
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (gradient on the device, its host destination)
    norm_sq: torch.Tensor  # squared norm, computed on the device
    ready: Any  # event recorded on compute once the gradients exist (None on the CPU path)
    scatter: Callable[[], None] | None = None  # host work once landed (the embedding rows into its gradient)
    permit: threading.Semaphore | None = None  # a decoder layer's place among the sets in flight, given back
    # once the gradients have landed (see GRAD_SETS_IN_FLIGHT)


@dataclass
class Sends:
    """One step's sends (or one send_held's): whom they report to, and which unit each host slot took last."""

    landed: LandedCallback
    slot_free: UnitCallback
    slot_users: dict[int, Unit] = field(default_factory=dict)  # host slot id -> the unit written into it last
    in_flight: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(GRAD_SETS_IN_FLIGHT))


@dataclass
class Landing:
    """A GradsOut whose copies to the host are queued: what is left is to wait for them and report."""

    out: GradsOut
    landed: LandedCallback
    event: Any  # recorded on d2h after the copies (None on the CPU path: they are done)
    norm_sq: torch.Tensor  # the squared norm's host copy
    settled: bool = False  # the sender thread is done with it (finished, or dropped after a failure)


class GradEgress:
    """Sends units' gradients to the host: inline, or through a sender thread (send_thread)."""

    def __init__(self, streams: Streams, grad_layout: GradLayout, recorder: Recorder, send_thread: bool):
        self.streams, self.grad_layout, self.rec, self.send_thread = streams, grad_layout, recorder, send_thread
        # each unit's squared gradient norm lands here (page-locked on a GPU: one buffer, not one per unit)
        self._norms_host = streams.pinned(len(grad_layout.slot_of), dtype=torch.float64)
        self._outbox: queue.Queue[tuple[GradsOut, Sends] | None] = queue.Queue()
        self._outbox_error: BaseException | None = None
        self._sender: threading.Thread | None = None
        self._sender_lock = threading.Lock()  # one sender thread, whichever threads emit

    def permit(self, sends: Sends, unit: Unit) -> threading.Semaphore:
        """Waits until fewer than GRAD_SETS_IN_FLIGHT layers' gradients are on the device (the others on their
        way to the host, held up by copies or by the optimizer freeing slots): compute stalls rather than
        the device running out of memory (a "gradients" wait; the sender's slot waits say when the optimizer held
        it up). Returns the semaphore to release once `unit`'s gradients landed."""
        if not sends.in_flight.acquire(blocking=False):
            with self.rec.wait("gradients", unit.index):
                sends.in_flight.acquire()
        return sends.in_flight

    def emit(self, out: GradsOut, sends: Sends) -> None:
        """Sends `out` to the host: through the sender thread (on a GPU), so compute never waits on a slot or a
        copy; else at once."""
        if not self.send_thread:
            self._finish(self._start(out, sends))
            return
        with self._sender_lock:
            if self._sender is None or not self._sender.is_alive():
                self._sender = threading.Thread(target=self._send_loop, name="grads-out", daemon=True)
                self._sender.start()
        self._outbox.put((out, sends))

    def wait_sent(self) -> None:
        """Waits until everything emitted has landed; raises what failed on the sender thread since the last call."""
        if self._sender is not None:
            self._outbox.join()
        if self._outbox_error is not None:
            err, self._outbox_error = self._outbox_error, None
            raise err

    def abandon(self) -> None:
        """After a failed step: what it queued for the sender thread is dropped, and the thread is idle again
        before anything else runs (its own error, if any, is superseded by the step's)."""
        if self._sender is None:
            return
        if self._outbox_error is None:
            self._outbox_error = MegatrainError("the step failed before its gradients were all sent.")
        self._outbox.join()
        self._outbox_error = None

    def send_held(self, held: list[GradsOut], landed: LandedCallback = noop, slot_free: UnitCallback = noop
                  ) -> None:
        """Copies gradients a `run(hold_grads=True)` held on the device to the host, in forward order (the
        order the next forward reads the updated weights), calling `landed` as each unit's arrives. Runs in
        the calling thread, which may be another than the one running the next step. Each unit's copies are
        queued before the previous unit is waited for, and each unit's device memory goes once it landed."""
        sends = Sends(landed, slot_free)
        landing: Landing | None = None
        try:
            while held:
                landing = self._start_after(landing, self._finish, held.pop(), sends)
            if landing is not None:
                self._finish(landing)
        finally:
            held.clear()

    def close(self) -> None:
        """Stops the sender thread once what was emitted before has been sent."""
        if self._sender is not None and self._sender.is_alive():
            self._outbox.put(None)
            self._sender.join(timeout=5)

    # ---- the state machine ----
    def _start(self, out: GradsOut, sends: Sends) -> Landing:
        """Waits for the unit's host slot to be free and queues the copies of its gradients (and their norm)
        into it on the d2h stream."""
        slot = self.grad_layout.slot_of[out.unit.index]
        previous = sends.slot_users.get(slot)
        if previous is not None and previous.index != out.unit.index:
            with self.rec.span(EGRESS_LANE, "slot", previous.index):
                sends.slot_free(previous)
        sends.slot_users[slot] = out.unit
        s = self.streams
        s.wait(s.d2h, out.ready)
        nbytes = sum(g.numel() * 4 for g, _ in out.pairs)
        with self.rec.span("d2h", "grads", out.unit.index, s.d2h, nbytes):
            for g, dst in out.pairs:
                s.copy(dst, g, s.d2h)
            # the norm comes along on this stream: reading it on this thread's default stream (the compute
            # stream) would wait for every kernel queued there since, up to a layer of compute
            norm_sq = self._norms_host[out.unit.index]
            s.copy(norm_sq, out.norm_sq, s.d2h)
        return Landing(out, sends.landed, s.record(s.d2h, blocking=True), norm_sq)

    def _finish(self, landing: Landing) -> None:
        """Waits for a unit's gradients to land, scatters what needs it and calls `landed(unit, norm²)`; the
        device copies may be freed from here on."""
        if landing.event is not None:
            landing.event.synchronize()
        out = landing.out
        if out.scatter is not None:
            out.scatter()
        landing.landed(out.unit, float(landing.norm_sq))
        self._release(out)

    @staticmethod
    def _release(out: GradsOut) -> None:
        """The device side of `out` is no longer needed: its tensors go, its place in flight is given back."""
        out.pairs.clear()
        if out.permit is not None:
            out.permit.release()
            out.permit = None

    def _start_after(self, landing: Landing | None, finish: Callable[[Landing], None], out: GradsOut,
                     sends: Sends) -> Landing:
        """Starts `out`, then finishes `landing` (the unit before it), so that their copies overlap; first, if
        `out` is to reuse that unit's host slot (whose `slot_free` waits for it to have landed)."""
        slot_of = self.grad_layout.slot_of
        if landing is not None and slot_of[landing.out.unit.index] == slot_of[out.unit.index]:
            finish(landing)
            landing = None
        started = self._start(out, sends)
        if landing is not None:
            finish(landing)
        return started

    def _send_loop(self) -> None:
        """The sender thread. A unit's copies are queued as soon as its slot is free, and the unit before is
        finished only then (or once the outbox is empty), so that the D2H copies follow each other on the
        stream instead of each waiting for the host to see the previous one land."""
        landing: Landing | None = None  # started, not finished
        while True:
            if landing is None:
                item = self._outbox.get()
            else:
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    self._settle(landing)
                    landing = None
                    continue
            if item is None:
                if landing is not None:
                    self._settle(landing)
                return
            started = None
            if self._outbox_error is None:  # after a failure the step's remaining units are dropped
                try:
                    started = self._start_after(landing, self._settle, *item)
                except BaseException as e:  # surfaced by the step that queued it
                    self._outbox_error = e
            if started is None:
                self._release(item[0])
                self._outbox.task_done()
                if landing is not None:
                    self._settle(landing)
            del item  # a delivered unit's gradients must not stay alive here until the next one comes
            landing = started

    def _settle(self, landing: Landing) -> None:
        """Finishes a started unit on the sender thread (unless an earlier one failed) and marks it done."""
        if landing.settled:
            return
        landing.settled = True
        try:
            if self._outbox_error is None:
                self._finish(landing)
        except BaseException as e:
            self._outbox_error = e
        finally:
            self._release(landing.out)
            self._outbox.task_done()
