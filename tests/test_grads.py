"""Gradient placements without Ray: the ring of host gradient slots (GradLayout.ring), the executor's
slot-reuse waits, gradients held on the device and sent out later in forward order, and the optimizer
shard reading each unit's gradient from its slot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain.config import ModelConfig, OptimConfig
from megatrain.engine.executor import Executor, StepOutput
from megatrain.engine.optimizer import AdamWShard
from megatrain.model.layout import GradLayout, ModelLayout, Unit
from megatrain.store import init_weights

CONFIG = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=6)
SLOTS = 2


@pytest.fixture(scope="module")
def layout() -> ModelLayout:
    return ModelLayout.build(CONFIG)


@pytest.fixture(scope="module")
def params(layout: ModelLayout) -> torch.Tensor:
    p = torch.zeros(layout.numel)
    init_weights(layout, p, seed=3)
    return p


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.fixture(scope="module")
def reference(layout: ModelLayout, params: torch.Tensor, batch) -> tuple[torch.Tensor, list[float]]:
    """Every gradient in its own range of a full-size buffer."""
    grads = torch.zeros(layout.numel)
    out = Executor(CONFIG, layout, params, grads).run(*batch)
    return grads, out.unit_grad_norms_sq


def test_ring_layout(layout: ModelLayout) -> None:
    ring = GradLayout.ring(layout, slots=SLOTS)
    embed, head, layers = layout.embed, layout.head, layout.layers
    assert ring.numel == embed.numel + SLOTS * layout.max_layer_numel() + head.numel < layout.numel
    ranges = {}
    for unit in layout.units:
        start = ring.offsets[unit.index]
        assert 0 <= start and start + unit.numel <= ring.numel
        ranges.setdefault(ring.slot_of[unit.index], set()).add((start, unit.numel))
    assert all(len(r) == 1 for r in ranges.values()), "units sharing a slot id share one range"
    spans = sorted(next(iter(r)) for r in ranges.values())
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False)), "distinct slots never overlap"
    assert [ring.slot_of[u.index] for u in layers] == [2, 3, 2, 3, 2, 3]
    assert GradLayout.ring(ModelLayout.build(ModelConfig.from_name("tiny")), slots=4).numel == \
        ModelLayout.build(ModelConfig.from_name("tiny")).numel, "never more slots than layers"
    assert GradLayout.full(layout).offsets == tuple(u.offset for u in layout.units)


def _landed_copies(ring: GradLayout, grads: torch.Tensor, log: list[tuple[str, int]]):
    """A `landed` callback that copies each unit's gradient out of its slot the moment it lands (what the
    optimizer does), and a record of the calls."""
    copies: dict[int, torch.Tensor] = {}

    def landed(unit: Unit, norm_sq: float) -> None:
        copies[unit.index] = ring.range_of(unit, grads).clone()
        log.append(("landed", unit.index))

    return copies, landed


def _check_against_reference(layout: ModelLayout, copies: dict[int, torch.Tensor], reference: torch.Tensor) -> None:
    assert sorted(copies) == [u.index for u in layout.units]
    for unit in layout.units:  # tensor by tensor: the alignment padding between them is never written
        ours, ref = unit.bind(copies[unit.index]), unit.bind(unit.range_of(reference))
        for name in ref:
            assert torch.equal(ours[name], ref[name]), name


@pytest.mark.parametrize("send_thread", [False, True], ids=["inline", "sender-thread"])
def test_streamed_gradients_wait_for_their_slot(layout, params, batch, reference, send_thread: bool) -> None:
    """send_thread: the path a GPU takes (slot waits, copies and `landed` on a thread of their own), here
    without CUDA; the same gradients, norms and order of events as the inline path."""
    ring = GradLayout.ring(layout, slots=SLOTS)
    grads = torch.full((ring.numel,), float("nan"))  # a slot's old contents must never leak into a gradient
    log: list[tuple[str, int]] = []
    copies, landed = _landed_copies(ring, grads, log)
    executor = Executor(CONFIG, layout, params, grads, grad_layout=ring, send_thread=send_thread)
    out = executor.run(*batch, grads_landed=landed, slot_free=lambda unit: log.append(("free", unit.index)))
    executor.close()
    assert out.held == [] and out.unit_grad_norms_sq == reference[1]
    _check_against_reference(layout, copies, reference[0])
    # backward order (head, layers from the top, embedding)
    _check_slot_waits(log, [layout.head, *reversed(layout.layers), layout.embed], ring)


def _check_slot_waits(log: list[tuple[str, int]], order: list[Unit], ring: GradLayout) -> None:
    """Units land in `order`; before a unit is written into a slot another unit used, that unit's slot wait
    (`free`) comes, once, after it landed. (A unit's copies may be queued before the unit ahead of it has
    landed, so the events of neighbours interleave.)"""
    assert [i for kind, i in log if kind == "landed"] == [u.index for u in order]
    at = {event: n for n, event in enumerate(log)}
    expected_frees = []
    for n, unit in enumerate(order):
        previous = [u for u in order[:n] if ring.slot_of[u.index] == ring.slot_of[unit.index]]
        if previous:
            free = ("free", previous[-1].index)
            expected_frees.append(free)
            assert at[("landed", previous[-1].index)] < at[free] < at[("landed", unit.index)], (unit, log)
    assert [e for e in log if e[0] == "free"] == expected_frees


def test_a_failure_on_the_sender_thread_fails_the_step_and_stops_its_units(layout, params, batch) -> None:
    """An error while sending (a slot wait or `landed` failing: a dead optimizer worker) is raised by the
    step that queued it, the step's later units are not handed on, and the next step runs clean."""
    executor = Executor(CONFIG, layout, params, torch.zeros(layout.numel), send_thread=True)
    landed: list[int] = []
    broken = layout.layers[3].index

    def fail_on_one(unit: Unit, norm_sq: float) -> None:
        if unit.index == broken:
            raise RuntimeError("worker died")
        landed.append(unit.index)

    with pytest.raises(RuntimeError, match="worker died"):
        executor.run(*batch, grads_landed=fail_on_one)
    assert broken not in landed and layout.embed.index not in landed, landed  # nothing after the failure
    landed.clear()
    executor.run(*batch, grads_landed=lambda unit, norm_sq: landed.append(unit.index))
    assert sorted(landed) == sorted(u.index for u in layout.units)
    executor.close()


def test_held_gradients_go_out_in_forward_order(layout, params, batch, reference) -> None:
    ring = GradLayout.ring(layout, slots=SLOTS)
    grads = torch.full((ring.numel,), float("nan"))
    log: list[tuple[str, int]] = []
    copies, landed = _landed_copies(ring, grads, log)
    executor = Executor(CONFIG, layout, params, grads, grad_layout=ring)
    out = executor.run(*batch, grads_landed=landed, hold_grads=True)
    assert log == [] and bool(grads.isnan().all()), "held: nothing reaches the host during the step"
    assert out.unit_grad_norms_sq == reference[1], "the norms for clipping are known before anything is sent"
    executor.send_held(out.held, landed, slot_free=lambda unit: log.append(("free", unit.index)))
    _check_against_reference(layout, copies, reference[0])
    _check_slot_waits(log, [layout.embed, *layout.layers, layout.head], ring)


def test_optimizer_reads_each_unit_from_its_slot(layout, params, reference) -> None:
    """AdamW from ring slots, each unit updated while its gradient sits in its slot, equals AdamW from the
    full gradient buffer."""
    ring = GradLayout.ring(layout, slots=SLOTS)
    optim = OptimConfig(lr=1e-2)
    full = {"params": params.clone(), "grads": reference[0].clone(), "exp_avg": torch.zeros(layout.numel),
            "exp_avg_sq": torch.zeros(layout.numel)}
    reference_shard = AdamWShard(layout, full, optim, 0, 1)
    for unit in layout.units:
        reference_shard.update(unit.index, step=0)
    slotted = {"params": params.clone(), "grads": torch.zeros(ring.numel), "exp_avg": torch.zeros(layout.numel),
               "exp_avg_sq": torch.zeros(layout.numel)}
    shard = AdamWShard(layout, slotted, optim, 0, 1, grad_layout=ring)
    for unit in layout.units:
        ring.range_of(unit, slotted["grads"]).copy_(unit.range_of(reference[0]))
        shard.update(unit.index, step=0)
    assert torch.equal(slotted["params"], full["params"])
    assert torch.equal(slotted["exp_avg_sq"], full["exp_avg_sq"])


def test_queue_depth_is_what_was_handed_out_and_not_yet_applied(layout, params, reference) -> None:
    tensors = {"params": params.clone(), "grads": reference[0].clone(), "exp_avg": torch.zeros(layout.numel),
               "exp_avg_sq": torch.zeros(layout.numel)}
    units = len(layout.units)
    versions, issued = torch.zeros(units, 2, dtype=torch.int64), torch.zeros(units, dtype=torch.int64)
    shard = AdamWShard(layout, tensors, OptimConfig(), 1, 2, versions, issued=issued)
    assert shard.queue_depth() == 0
    issued[:3] = 1  # three units' gradients have landed and were handed out
    assert shard.queue_depth() == 3
    shard.update(0, step=0)
    assert shard.queue_depth() == 2 and versions[0].tolist() == [0, 1]
    versions[:, 0] = 1  # the other worker's progress is not this worker's queue
    assert shard.queue_depth() == 2


def test_a_step_with_a_non_finite_gradient_is_not_finite() -> None:
    """What the executor actor reads to drop a skipped step's gradients held on the device at once."""
    assert StepOutput(1.0, 3, [1.0, 2.0]).finite
    assert not StepOutput(1.0, 3, [1.0, float("inf")]).finite
    assert not StepOutput(float("nan"), 3).finite
