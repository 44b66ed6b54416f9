"""The gradient egress on its own (megatrain/engine/grad_egress.py), without a model or Ray: units of gradients
sent inline and through the sender thread, from several threads at once, under simulated streams. Each unit
lands once, in the order it was sent, after its host slot was freed; failures surface where the docstring says;
close and abandon leave nothing behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from megatrain.engine.grad_egress import GradEgress, GradsOut, Sends, noop
from megatrain.engine.streams import Streams, make_streams
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, GradLayout, Unit
from megatrain.telemetry import Recorder

N = 16  # elements of each unit's gradient
DEVICES = ["cpu", "cpu-async:0"]


def units(count: int) -> list[Unit]:
    return [Unit(i, "layer", i * N, N, (), i) for i in range(count)]


def full(count: int) -> GradLayout:
    """Every unit a range of its own."""
    return GradLayout(tuple(i * N for i in range(count)), tuple(range(count)), count * N)


def ring(count: int, slots: int) -> GradLayout:
    """Unit i writes slot i % slots."""
    return GradLayout(tuple(i % slots * N for i in range(count)), tuple(i % slots for i in range(count)), slots * N)


def value_of(unit: Unit) -> float:
    return float(unit.index + 1)


def grads_out(streams: Streams, unit: Unit, grad_layout: GradLayout, host: torch.Tensor,
              permit: threading.Semaphore | None = None) -> GradsOut:
    """`unit`'s gradient (every element value_of(unit)) on the device, bound for its range of `host`."""
    g = torch.full((N,), value_of(unit))
    norm_sq = torch.tensor(N * value_of(unit) ** 2, dtype=torch.float64)
    streams.compute_uses(g, norm_sq)
    return GradsOut(unit, [(g, grad_layout.range_of(unit, host))], norm_sq, streams.record(streams.compute),
                    permit=permit)


@pytest.fixture(params=DEVICES)
def streams(request: pytest.FixtureRequest) -> Iterator[Streams]:
    s = make_streams(request.param)
    yield s
    s.close()


class Log:
    """What the callbacks saw, in order, from whichever thread: ("landed" | "free", unit index)."""

    def __init__(self, grad_layout: GradLayout, host: torch.Tensor):
        self.grad_layout, self.host = grad_layout, host
        self.events: list[tuple[str, int]] = []
        self.norms: dict[int, float] = {}
        self.lock = threading.Lock()

    def landed(self, unit: Unit, norm_sq: float) -> None:
        slot = self.grad_layout.range_of(unit, self.host)
        assert torch.equal(slot, torch.full((N,), value_of(unit))), "landed before its copy did"
        with self.lock:
            assert unit.index not in self.norms, f"unit {unit.index} landed twice"
            self.events.append(("landed", unit.index))
            self.norms[unit.index] = norm_sq

    def slot_free(self, unit: Unit) -> None:
        # the previous occupant has landed and nothing has overwritten it yet
        assert torch.equal(self.grad_layout.range_of(unit, self.host), torch.full((N,), value_of(unit)))
        with self.lock:
            self.events.append(("free", unit.index))

    def landed_order(self) -> list[int]:
        return [i for kind, i in self.events if kind == "landed"]


def send_step(egress: GradEgress, streams: Streams, layout: GradLayout, host: torch.Tensor, count: int) -> Log:
    """Units 0..count-1 sent as one step, each with its place in flight, waited for; what the callbacks saw."""
    log = Log(layout, host)
    sends = Sends(log.landed, log.slot_free)
    for unit in units(count):
        egress.emit(grads_out(streams, unit, layout, host, egress.permit(sends, unit)), sends)
    egress.wait_sent()
    return log


def sender_threads() -> int:
    return sum(t.name == "grads-out" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("send_thread", [False, True], ids=["inline", "sender-thread"])
def test_every_unit_lands_once_in_order_after_its_slot_is_freed(streams: Streams, send_thread: bool) -> None:
    count, slots, before = 24, 3, sender_threads()
    layout = ring(count, slots)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread)
    log = send_step(egress, streams, layout, host, count)
    assert log.landed_order() == list(range(count))
    assert log.norms == {u.index: N * value_of(u) ** 2 for u in units(count)}
    at = {event: n for n, event in enumerate(log.events)}
    assert [i for kind, i in log.events if kind == "free"] == list(range(count - slots)), "each freed once"
    for i in range(count - slots):  # unit i's slot is freed after it landed, before its next occupant lands
        assert at[("landed", i)] < at[("free", i)] < at[("landed", i + slots)]
    egress.close()
    assert sender_threads() == before


def test_units_sent_from_several_threads_each_land_once_in_their_order(streams: Streams) -> None:
    """Four threads emit through one sender thread at once, each its own step (Sends) over its own units,
    each waiting for its places in flight: every unit lands once, each thread's in the order it sent them."""
    threads, per_thread, before = 4, 16, sender_threads()
    layout = full(threads * per_thread)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread=True)
    log = Log(layout, host)
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def step(t: int) -> None:
        try:
            sends = Sends(log.landed, log.slot_free)
            start.wait()
            for unit in units(threads * per_thread)[t * per_thread : (t + 1) * per_thread]:
                permit = egress.permit(sends, unit)
                egress.emit(grads_out(streams, unit, layout, host, permit), sends)
            egress.wait_sent()
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=step, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert not errors, errors
    assert sorted(log.landed_order()) == list(range(threads * per_thread))
    for t in range(threads):
        mine = [i for i in log.landed_order() if i // per_thread == t]
        assert mine == list(range(t * per_thread, (t + 1) * per_thread))
    assert sender_threads() == before + 1, "one sender thread, however many threads emit"
    egress.close()
    assert sender_threads() == before


def test_permits_bound_the_gradient_sets_in_flight(streams: Streams) -> None:
    """A slow optimizer (slot waits of 20 ms): the thread computing gradients waits for a place rather than
    running ahead; GRAD_SETS_IN_FLIGHT sets are on the device at most, and that many at times."""
    count = 12
    layout = ring(count, 2)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread=True)
    alive, peak, lock = [0], [0], threading.Lock()

    def landed(unit: Unit, norm_sq: float) -> None:
        with lock:
            alive[0] -= 1

    sends = Sends(landed, lambda unit: time.sleep(0.02))
    for unit in units(count):
        permit = egress.permit(sends, unit)
        with lock:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
        egress.emit(grads_out(streams, unit, layout, host, permit), sends)
    egress.wait_sent()
    egress.close()
    assert peak[0] == GRAD_SETS_IN_FLIGHT and alive[0] == 0


def test_held_gradients_go_out_in_forward_order_while_another_step_sends(streams: Streams) -> None:
    """send_held on one thread (the last step's held gradients, forward order) while the sender thread
    sends another step's: both arrive whole, each unit once."""
    count = 16
    layout = full(2 * count)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread=True)
    held_log, sent_log = Log(layout, host), Log(layout, host)
    every = units(2 * count)
    held = [grads_out(streams, unit, layout, host) for unit in reversed(every[:count])]  # backward order
    sender = threading.Thread(target=egress.send_held, args=(held, held_log.landed, held_log.slot_free))
    sender.start()
    sends = Sends(sent_log.landed, sent_log.slot_free)
    for unit in reversed(every[count:]):
        egress.emit(grads_out(streams, unit, layout, host), sends)
    egress.wait_sent()
    sender.join(timeout=30)
    assert held == [] and held_log.landed_order() == list(range(count))
    assert sent_log.landed_order() == list(reversed(range(count, 2 * count)))
    egress.close()


def test_held_gradients_wait_for_their_slot(streams: Streams) -> None:
    layout = ring(8, 2)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread=False)
    log = Log(layout, host)
    held = [grads_out(streams, unit, layout, host) for unit in reversed(units(8))]
    egress.send_held(held, log.landed, log.slot_free)
    assert held == []
    # unit i's copies are queued (after its slot's previous occupant i - 2 is freed) before unit i - 1 lands
    assert log.events == [("landed", 0)] + [
        event for i in range(2, 8) for event in (("free", i - 2), ("landed", i - 1))] + [("landed", 7)]


def test_close_lets_the_sends_in_flight_land(streams: Streams) -> None:
    count, before = 20, sender_threads()
    layout = full(count)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread=True)
    log = Log(layout, host)

    def slow_landed(unit: Unit, norm_sq: float) -> None:
        time.sleep(0.002)
        log.landed(unit, norm_sq)

    sends = Sends(slow_landed, noop)
    for unit in units(count):
        egress.emit(grads_out(streams, unit, layout, host), sends)
    egress.close()  # while most are still queued
    assert log.landed_order() == list(range(count)) and sender_threads() == before
    egress.close()  # twice: nothing left to stop


@pytest.mark.parametrize("failing", ["landed", "slot_free"])
@pytest.mark.parametrize("send_thread", [False, True], ids=["inline", "sender-thread"])
def test_a_failing_callback_is_raised_and_the_units_after_it_are_dropped(streams: Streams, send_thread: bool,
                                                                          failing: str) -> None:
    """Inline, the error comes out of emit; on the sender thread, out of the step's wait_sent, and the units
    queued after it are released (their device tensors and places in flight) without landing. The next step
    runs clean."""
    count, slots, broken = 10, 2, 5
    layout = ring(count, slots)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread)
    log = Log(layout, host)

    def landed(unit: Unit, norm_sq: float) -> None:
        if failing == "landed" and unit.index == broken:
            raise RuntimeError("worker died")
        log.landed(unit, norm_sq)

    def slot_free(unit: Unit) -> None:  # before `broken` reuses the slot of the unit two before it
        if failing == "slot_free" and unit.index == broken - slots:
            raise RuntimeError("worker died")
        log.slot_free(unit)

    sends = Sends(landed, slot_free)
    outs = []
    with pytest.raises(RuntimeError, match="worker died"):
        for unit in units(count):
            out = grads_out(streams, unit, layout, host, egress.permit(sends, unit))
            outs.append(out)
            egress.emit(out, sends)
        egress.wait_sent()
    order = log.landed_order()
    assert order == list(range(len(order))), "in order, and none after the failure"
    # on the sender thread, unit broken - 1 may be started, not finished, when the unit after it fails to start
    assert len(order) == broken or (failing == "slot_free" and send_thread and len(order) == broken - 1)
    if send_thread:  # every unit's device side released, its place in flight given back
        assert all(out.pairs == [] and out.permit is None for out in outs)
        assert sends.in_flight.acquire(blocking=False) and sends.in_flight.acquire(blocking=False)
    else:  # the step stops at the unit that failed, which its caller drops
        assert len(outs) == broken + 1 and all(out.pairs == [] for out in outs[:-1])
    assert send_step(egress, streams, layout, host, count).landed_order() == list(range(count))
    egress.close()


def test_abandon_drops_the_queued_units_and_leaves_the_sender_idle(streams: Streams) -> None:
    """A step fails while its units wait in the outbox: abandon returns once the sender thread has dropped
    them (the one landing at that moment finishes), and raises nothing later."""
    count = 10
    layout = full(count)
    host = torch.zeros(layout.numel)
    egress = GradEgress(streams, layout, Recorder(enabled=False), send_thread=True)
    log = Log(layout, host)
    landing, gate = threading.Event(), threading.Event()

    def held_up(unit: Unit, norm_sq: float) -> None:
        landing.set()
        assert gate.wait(timeout=30)
        log.landed(unit, norm_sq)

    sends = Sends(held_up, log.slot_free)
    permits = [threading.Semaphore(0) for _ in range(count)]  # given back once landed or dropped
    outs = [grads_out(streams, unit, layout, host, permit) for unit, permit in zip(units(count), permits, strict=True)]
    for out in outs:
        egress.emit(out, sends)
    assert landing.wait(timeout=30)  # unit 0 is landing, the others wait
    abandon = threading.Thread(target=egress.abandon)
    abandon.start()
    deadline = time.monotonic() + 30
    while egress._outbox_error is None and time.monotonic() < deadline:  # abandon has marked the step failed
        time.sleep(0.001)
    gate.set()
    abandon.join(timeout=30)
    assert not abandon.is_alive()
    assert log.landed_order() == [0], "the unit landing when the step failed, and none after it"
    assert all(out.pairs == [] and out.permit is None for out in outs)
    assert all(permit.acquire(blocking=False) for permit in permits)
    egress.wait_sent()  # nothing to raise: the step's own error supersedes the sender's
    assert send_step(egress, streams, layout, host, count).landed_order() == list(range(count))
    egress.close()
