"""The GPU's asynchrony simulated on the CPU (device "cpu-async:SEED", megatrain/engine/streams.py).

The executor's schedule runs with copies on late worker threads, poisoned buffers and order checks; it must
give the synchronous CPU path's results bit for bit, and a wait removed on purpose must make it fail.
Engine-level runs under the simulator are in test_engine.py, test_faults.py and test_bf16_copy_weights.py.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, assert_matches_hf, batch, build_hf_model, hf_loss_and_grads, make_labels

import megatrain
from megatrain.config import ModelConfig
from megatrain.engine import grad_egress, layer_passes
from megatrain.engine.executor import Executor
from megatrain.engine.grad_egress import GradEgress, Landing
from megatrain.engine.streams import SimulatedStreams, StreamOrderError, make_streams
from megatrain.engine.weight_slots import WeightSlots
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, GradLayout, ModelLayout, Unit
from megatrain.model.templates import recompute_grads

SEEDS = [0, 1, 2]  # CI; the slow marker runs SLOW_SEEDS
SLOW_SEEDS = list(range(3, 23))
CONFIG = ModelConfig(vocab_size=260, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                     intermediate_size=96)


# ---- the simulated streams themselves ----

def test_a_copy_lands_late_and_reads_as_nan_until_then() -> None:
    s = SimulatedStreams(seed=0, max_delay=0.05)
    dst, src = torch.zeros(4), torch.arange(4.0)
    s.copy(dst, src, s.h2d)
    assert dst.isnan().all(), "poisoned when queued: an early read sees NaN, not a plausible stale value"
    event = s.record(s.h2d)
    s.wait(s.compute, event)  # the compute stream is the calling thread: it blocks here
    assert torch.equal(dst, src) and event.query()
    s.close()


def test_copies_on_one_stream_run_in_order_and_waits_order_streams() -> None:
    s = SimulatedStreams(seed=1)
    log: list[str] = []
    a, b = torch.zeros(1), torch.zeros(1)
    s.wait(s.d2h, s.record(s.compute))
    for i in range(20):
        s.h2d.submit(lambda i=i: log.append(f"h2d{i}"))
    s.copy(a, torch.ones(1), s.h2d)
    s.wait(s.d2h, s.record(s.h2d))  # d2h runs after everything queued on h2d so far
    s.copy(b, a, s.d2h)
    s.synchronize()
    assert log == [f"h2d{i}" for i in range(20)] and b.item() == 1.0
    s.close()


def test_integer_buffers_are_poisoned_with_an_id_no_table_has() -> None:
    s = SimulatedStreams()
    t = torch.zeros(3, dtype=torch.int64)
    s.poison(t)
    with pytest.raises(IndexError):
        torch.nn.functional.embedding(t, torch.zeros(10, 2))
    s.close()


def test_a_buffer_reused_before_compute_frees_it_is_an_order_error() -> None:
    s = SimulatedStreams()
    buffer = torch.zeros(8)
    s.copy(buffer, torch.ones(8), s.h2d)
    s.wait(s.compute, s.record(s.h2d))
    s.compute_uses(buffer)
    with pytest.raises(StreamOrderError, match="overwrite it while compute reads it"):
        s.copy(buffer, torch.ones(8), s.h2d)  # no wait on a compute event recorded after the use
    s.wait(s.h2d, s.record(s.compute))
    s.copy(buffer, torch.ones(8), s.h2d)  # now it is ordered
    s.synchronize()
    s.close()


def test_compute_reading_before_its_copy_is_waited_for_is_an_order_error() -> None:
    s = SimulatedStreams()
    buffer = torch.zeros(8)
    s.copy(buffer, torch.ones(8), s.h2d)
    with pytest.raises(StreamOrderError, match="before waiting for the h2d copy"):
        s.compute_uses(buffer)
    s.close()


def test_a_result_copied_out_before_compute_made_it_is_an_order_error() -> None:
    s = SimulatedStreams()
    grad = torch.ones(8)
    s.compute_uses(grad)
    with pytest.raises(StreamOrderError, match="read it before compute wrote it"):
        s.copy(torch.zeros(8), grad, s.d2h)
    s.close()


def test_device_strings() -> None:
    assert isinstance(make_streams("cpu-async:7"), SimulatedStreams) and make_streams("cpu-async:7").seed == 7
    assert make_streams("cpu-async").device == torch.device("cpu")
    assert not make_streams("cpu").asynchronous


# ---- the executor under the simulator ----

@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gqa")
    build_hf_model(FAMILIES["llama-gqa"]()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen2")
    build_hf_model(FAMILIES["qwen2-tied"]()).save_pretrained(directory)
    return directory


def _loss_and_grads(directory: Path, device: str, precision: str = "fp32") -> tuple[torch.Tensor, dict]:
    input_ids = batch()
    with megatrain.from_pretrained(directory, device=device, precision=precision) as m:
        loss, grads = m.loss_and_grads(input_ids, make_labels("masked", input_ids))
        return loss, {k: v.clone() for k, v in grads.items()}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-tied"])
def test_parity_with_transformers_under_simulated_streams(gqa_dir, tied_dir, model, seed) -> None:
    directory = gqa_dir if model == "llama-gqa" else tied_dir
    hf = build_hf_model(FAMILIES[model]())
    input_ids = batch()
    labels = make_labels("masked", input_ids)
    hf_loss, hf_grads = hf_loss_and_grads(hf, input_ids, labels)
    loss, grads = _loss_and_grads(directory, f"cpu-async:{seed}")
    assert_matches_hf(loss, grads, hf_loss, hf_grads)
    sync_loss, sync_grads = _loss_and_grads(directory, "cpu")
    assert torch.equal(loss, sync_loss) and all(torch.equal(grads[k], sync_grads[k]) for k in grads)


@pytest.mark.parametrize("seed", SEEDS)
def test_bf16_under_simulated_streams_equals_the_cpu_path(gqa_dir, seed) -> None:
    """bf16 compute from fp32 weights: the staging buffer and the cast on the copy stream."""
    loss, grads = _loss_and_grads(gqa_dir, f"cpu-async:{seed}", "bf16")
    sync_loss, sync_grads = _loss_and_grads(gqa_dir, "cpu", "bf16")
    assert torch.equal(loss, sync_loss) and all(torch.equal(grads[k], sync_grads[k]) for k in grads)


# A wait taken out on purpose must fail the parity test: the simulator is what makes these bugs visible.

def _acquire_without_waiting(self: WeightSlots, unit: Unit) -> tuple[int, dict[str, torch.Tensor]]:
    if not self.copy_needed:
        return -1, unit.bind(unit.range_of(self.weights))
    slot = self.resident.index(unit.index)
    return slot, unit.bind(self.buffers[slot][: unit.numel])  # no wait for the copy, no compute_uses


def _fetch_without_waiting_for_compute(self: WeightSlots, unit: Unit, keep: Unit | None) -> None:
    saved, self.free = self.free, [None] * len(self.free)
    try:
        original_fetch(self, unit, keep)
    finally:
        self.free = saved


original_fetch = WeightSlots.fetch


def _finish_without_waiting(self: GradEgress, landing: Landing) -> None:
    landing.event = None  # the host reads the gradient before its copy out has landed
    original_finish(self, landing)


original_finish = GradEgress._finish


@pytest.mark.parametrize(("target", "replacement", "failure"), [
    (WeightSlots, ("acquire", _acquire_without_waiting), "nan"),
    (WeightSlots, ("fetch", _fetch_without_waiting_for_compute), StreamOrderError),
    (GradEgress, ("_finish", _finish_without_waiting), "nan"),
], ids=["compute-reads-weights-early", "h2d-overwrites-a-buffer-in-use", "host-reads-gradients-early"])
def test_a_removed_wait_fails_the_parity_test(gqa_dir, monkeypatch, target, replacement, failure) -> None:
    monkeypatch.setattr(target, *replacement)
    if failure is StreamOrderError:
        with pytest.raises(StreamOrderError):
            _loss_and_grads(gqa_dir, "cpu-async:0")
        return
    try:
        loss, grads = _loss_and_grads(gqa_dir, "cpu-async:0")
    except RuntimeError as e:  # the late copy landed inside a recompute: autograd saw its weights change
        assert "modified by an inplace operation" in str(e)
    else:
        assert not (loss.isfinite() and all(g.isfinite().all() for g in grads.values())), \
            "the poisoned buffer was read: NaN somewhere in the loss or the gradients"
    _loss_and_grads(gqa_dir, "cpu")  # the same variant passes on the synchronous path: only asynchrony shows it


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_parity_under_many_seeds_of_delays(gqa_dir, tied_dir, seed) -> None:
    for directory in (gqa_dir, tied_dir):
        loss, grads = _loss_and_grads(directory, f"cpu-async:{seed}")
        sync_loss, sync_grads = _loss_and_grads(directory, "cpu")
        assert torch.equal(loss, sync_loss) and all(torch.equal(grads[k], sync_grads[k]) for k in grads)


# ---- gradients in flight stay within the plan ----

@pytest.fixture
def small() -> Iterator[tuple[ModelLayout, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    layout = ModelLayout.build(CONFIG)
    params = torch.zeros(layout.numel)
    gen = torch.Generator().manual_seed(0)
    for unit in layout.units:
        for slot in unit.slots:
            view = unit.bind(unit.range_of(params))[slot.name]
            view.copy_(1.0 + 0.1 * torch.randn(view.shape, generator=gen) if slot.name.endswith("norm.weight")
                       else 0.05 * torch.randn(view.shape, generator=gen))
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=gen)
    yield layout, params, (ids, ids.clone())


def _run_with_a_slow_optimizer(layout: ModelLayout, params: torch.Tensor, batch_: tuple, seed: int,
                               monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[float]]:
    """Streams gradients through a ring of two host slots on the sender thread, the optimizer taking 30 ms to
    read a slot; returns the most decoder-layer gradient sets alive at once, and the norms."""
    alive, peak, lock = [0], [0], threading.Lock()

    def counted(*args, **kwargs):
        grad, wgrads = recompute_grads(*args, **kwargs)
        with lock:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])

        def gone() -> None:
            with lock:
                alive[0] -= 1

        weakref.finalize(next(iter(wgrads.values())), gone)
        return grad, wgrads

    monkeypatch.setattr(layer_passes, "recompute_grads", counted)
    ring = GradLayout.ring(layout, slots=2)  # four of the six layers wait for a slot
    landed_at: dict[int, float] = {}

    def landed(unit: Unit, norm_sq: float) -> None:
        landed_at[unit.index] = time.monotonic()

    def slot_free(unit: Unit) -> None:  # the optimizer is done reading `unit`'s slot 30 ms after it landed
        time.sleep(max(0.0, landed_at[unit.index] + 0.03 - time.monotonic()))

    executor = Executor(CONFIG, layout, params, torch.zeros(ring.numel), device=f"cpu-async:{seed}",
                        grad_layout=ring, send_thread=True)
    out = executor.run(*batch_, grads_landed=landed, slot_free=slot_free)
    executor.close()
    return peak[0], out.unit_grad_norms_sq


@pytest.mark.parametrize("seed", SEEDS)
def test_gradient_sets_on_the_device_never_exceed_the_plan(small, seed, monkeypatch) -> None:
    layout, params, batch_ = small
    peak, norms = _run_with_a_slow_optimizer(layout, params, batch_, seed, monkeypatch)
    assert peak <= GRAD_SETS_IN_FLIGHT, f"{peak} layers' gradients were alive at once"
    reference = Executor(CONFIG, layout, params, torch.zeros(layout.numel)).run(*batch_)
    assert norms == reference.unit_grad_norms_sq


def test_without_the_bound_the_host_runs_ahead(small, monkeypatch) -> None:
    """The check above can fail: with no bound, gradients pile up behind the slow optimizer."""
    layout, params, batch_ = small
    monkeypatch.setattr(grad_egress, "GRAD_SETS_IN_FLIGHT", 100)
    peak, _ = _run_with_a_slow_optimizer(layout, params, batch_, 0, monkeypatch)
    assert peak > GRAD_SETS_IN_FLIGHT


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("placement", ["arena", "ring", "held"])
def test_every_gradient_path_under_simulated_streams(small, seed, placement) -> None:
    """Inline, on the sender thread, and held then sent: the synchronous path's gradients, bit for bit."""
    layout, params, batch_ = small
    grad_layout = GradLayout.full(layout) if placement == "arena" else GradLayout.ring(layout)
    reference = Executor(CONFIG, layout, params, torch.zeros(layout.numel)).run(*batch_)
    ref_grads = torch.zeros(layout.numel)
    Executor(CONFIG, layout, params, ref_grads).run(*batch_)
    for send_thread in (False, True):
        grads = torch.zeros(grad_layout.numel)
        copies: dict[int, torch.Tensor] = {}

        def landed(unit: Unit, norm_sq: float, grads=grads, copies=copies) -> None:
            copies[unit.index] = grad_layout.range_of(unit, grads).clone()

        executor = Executor(CONFIG, layout, params, grads, device=f"cpu-async:{seed}", grad_layout=grad_layout,
                            send_thread=send_thread)
        out = executor.run(*batch_, grads_landed=landed, hold_grads=placement == "held")
        if placement == "held":
            assert not copies
            executor.send_held(out.held, landed)
        executor.close()
        assert out.unit_grad_norms_sq == reference.unit_grad_norms_sq
        for unit in layout.units:
            assert torch.equal(copies[unit.index], unit.range_of(ref_grads)), (placement, send_thread, unit.index)
