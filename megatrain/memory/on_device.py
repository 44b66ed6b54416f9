"""What the GPU holds beyond the pipeline's buffers and activation checkpoints, and how its spare memory is split
between the resident units (megatrain/memory/residency.py) and the decoder layers that keep their activations
(megatrain/memory/kept_activations.py): by predicted step time where a predictor is given, else by a rule from the
plan's counts (docs/design.md#the-devices-spare-memory)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from megatrain.config import ModelConfig
from megatrain.memory.buffers import (
    D2H,
    EMBED_GRAD_ROWS,
    GRADIENT_BUFFERS,
    H2D,
    HEAD,
    HEAD_CAST,
    HEAD_GRADS,
    Buffer,
    resident_buffers,
    total,
)
from megatrain.memory.crossings import crossings
from megatrain.memory.kept_activations import KeptLayers, plan_kept
from megatrain.memory.lora_plan import lora_resident
from megatrain.memory.residency import Residency, choose_resident, margin
from megatrain.model.layout import planning_layout

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan



class StepTime(Protocol):
    """A predictor of plans (megatrain/perf/predict.py: step_time): a plan's step in seconds, and how much of it the
    weights' copies to the device leave exposed beyond the compute they overlap with."""

    def __call__(self, plan: MemoryPlan) -> float: ...

    def h2d_exposed(self, plan: MemoryPlan) -> float: ...


AUTO = "auto"
SPLITS = 8  # the kept layers' count from resident first to kept first, in at most this many steps
# The rule's rates where no calibration predicts the split: the H100's as measured (benchmarks/RESULTS.md): a 7B
# layer's compute in bf16 (eager) and tf32, the 8192^3 matmul's in fp32; the CPU pool of 8 workers beside the copies
# in the 7B runs (3.0 to 3.2 G params/s on the H100 and the H200)
NOMINAL_TFLOPS = {"bf16": 311.0, "tf32": 141.0, "fp32": 52.0}
NOMINAL_POOL_GPARAMS = 3.1
NOMINAL_H2D_GBPS = 55.0  # PCIe host to device from the registered arena (the H100's, DESIGN.md)


def spare_budget(plan: MemoryPlan) -> int | None:
    """Device bytes the resident units and the kept layers share: what the plan leaves free, less the margin; None
    where it is not known (the CPU path, whose "device" is the host; a GPU whose free memory was not measured)."""
    if not plan.on_gpu or plan.gpu_free is None:
        return None
    room = plan.gpu_free - plan.gpu_total
    return room - margin(room)


def place_on_device(plan: MemoryPlan, config: ModelConfig, *, resident: int | str, keep_activations: int | str,
                    precision: str, world: int, step_time: StepTime | None = None, resident_weights: str = AUTO
                    ) -> MemoryPlan:
    """The plan with its resident units and kept layers placed as docs/design.md#the-devices-spare-memory says.
    world: executors of the run, all nodes'; step_time: the predictor the split is chosen by (None: the rule);
    resident_weights: "copy", "cast" or "auto" (EngineConfig.resident_weights). A LoRA run's resident units are its
    adapters' (lora_resident), and its layers keep no activations."""
    if plan.adapter_numels:
        plan = lora_resident(plan, config, resident, world)
        return _with_kept(plan, plan_kept(plan, config, keep_activations, precision, None))
    both = (resident_weights == AUTO and precision == "bf16" and step_time is not None and resident == AUTO
            and spare_budget(plan) is not None)
    if not both:
        return _placed(plan, config, resident, keep_activations, precision, world, step_time,
                       cast=resident_weights == "cast")
    assert step_time is not None
    names = ("a bf16 copy of their weights", "their bf16 weights cast at each use")
    ways = [_placed(plan, config, resident, keep_activations, precision, world, step_time, cast)
            for cast in (False, True)]
    times = [step_time(way) for way in ways]
    best = min((0, 1), key=times.__getitem__)  # the first of equals: the copy, no casts
    chosen = ways[best]
    if not chosen.resident_units:
        return chosen
    return replace(chosen, resident_note=f"{chosen.resident_note}; {names[best]}: {times[best]:.2f} s predicted, "
                                         f"against {times[1 - best]:.2f} s with {names[1 - best]}")


def _placed(plan: MemoryPlan, config: ModelConfig, resident: int | str, keep_activations: int | str, precision: str,
            world: int, step_time: StepTime | None, cast: bool) -> MemoryPlan:
    """place_on_device's placement with the resident units' weights as a bf16 copy, or cast at each use."""
    budget = spare_budget(plan)

    def resident_in(room: int | None) -> Residency:
        return choose_resident(config, resident, budget=room, on_gpu=plan.on_gpu, precision=precision, world=world,
                               held_grads=plan.grads == "device", cast=cast, summed=plan.micro_batches > 1)

    def kept_in(room: int | None) -> KeptLayers:
        return plan_kept(plan, config, keep_activations, precision, room)

    def less(room: int | None, used: int) -> int | None:
        return None if room is None else room - used

    if resident == AUTO and keep_activations != AUTO:  # the layers asked for first, the units in the rest
        kept = kept_in(budget)
        return with_on_device(plan, config, resident_in(less(budget, kept.bytes)), kept, precision)
    first = resident_in(budget)
    first_kept = kept_in(less(budget, first.bytes - first.freed_grads))  # what the units take, net
    if resident != AUTO or keep_activations != AUTO:
        return with_on_device(plan, config, first, first_kept, precision)
    last_kept = kept_in(budget)
    low, high = len(first_kept.indices), len(last_kept.indices)
    if low == high:  # room for no more kept layers without resident units: nothing to split
        return with_on_device(plan, config, first, first_kept, precision)
    per_layer = last_kept.bytes // high
    step = math.ceil((high - low) / SPLITS)
    splits = []
    for n in [*range(low, high, step), high]:  # n kept layers (auto: they fill n x per_layer), the units in the rest
        kept = kept_in(n * per_layer)
        splits.append((resident_in(less(budget, kept.bytes)), kept))
    if step_time is None:
        resident_first, note = rule(plan, precision)
        units, kept = splits[0] if resident_first else splits[-1]
    else:
        times = [step_time(with_on_device(plan, config, units, kept, precision)) for units, kept in splits]
        best = min(range(len(splits)), key=times.__getitem__)  # the first of equals: more resident units
        units, kept = splits[best]
        note = (f"the spare GPU memory split for the shortest predicted step of {len(splits)} splits: "
                f"{times[best]:.2f} s, against {times[0]:.2f} s resident-first and {times[-1]:.2f} s kept-first")
    return with_on_device(plan, config, replace(units, why=f"{units.why}; {note}"),
                          replace(kept, why=f"{kept.why}; {note}"), precision)


def rule(plan: MemoryPlan, precision: str) -> tuple[bool, str]:
    """Without a calibration: (resident first?, why), from the CPU pool's update of every parameter (this node's
    share) against the backward's compute (forward recomputed: 6 FLOPs a parameter and token) at the nominal rates."""
    update = plan.params / plan.nodes / (NOMINAL_POOL_GPARAMS * 1e9)
    tflops = NOMINAL_TFLOPS.get(precision, NOMINAL_TFLOPS["fp32"])
    backward = 6 * plan.params * plan.step_tokens / (tflops * 1e12)
    pool = f"the CPU pool's update (~{update:.2f} s at a nominal {NOMINAL_POOL_GPARAMS:g} G params/s)"
    compute = f"the backward's compute (~{backward:.2f} s at a nominal {tflops:g} TFLOP/s)"
    first, longer, shorter = ("resident", pool, compute) if update > backward else ("kept", compute, pool)
    return update > backward, f"{first} first: no calibration to predict the split by, and {longer} exceeds {shorter}"


def with_on_device(plan: MemoryPlan, config: ModelConfig, units: Residency, kept: KeptLayers, precision: str
                   ) -> MemoryPlan:
    """The plan with these units resident and these layers keeping their activations (on the CPU path, whose device
    is the host, their bytes are host memory), and what no longer crosses PCIe: the resident units' weights (in twice
    a pass), gradients (out once), and the embedding's rows."""
    plan = _with_kept(replace(plan, resident_note=units.describe()), kept)
    if not units.units:
        return plan
    pcie: dict[str, Any] = {}  # what crosses with them on the device (a LoRA plan's adapters: lora_resident)
    if plan.step.tokens:
        rows = (*(b for b in plan.buffers if b.place not in (H2D, D2H)),
                *crossings(config, planning_layout(config), plan.step, units.units, units.cast))
        pcie = dict(h2d_bytes=total(rows, place=H2D), d2h_bytes=total(rows, place=D2H), buffers=rows)
    compute = "bfloat16" if precision == "bf16" else "float32"
    state = resident_buffers(units.params, compute, units.cast)  # as the executor allocates them (resident.py)
    rows, gpu_grads = (*pcie.get("buffers", plan.buffers), *state), plan.gpu_grads - units.freed_grads
    if plan.grads == "device" and plan.step.tokens:  # the held gradients of the streamed units alone
        rows = tuple(replace(b, count=config.num_layers - units.layers) if b.name == GRADIENT_BUFFERS else b
                     for b in rows if not (b.name == HEAD_GRADS and units.head))
        gpu_grads = total(rows, GRADIENT_BUFFERS, HEAD_GRADS, EMBED_GRAD_ROWS)
    rows, weights = _head_copy(rows, config, units, plan.gpu_weights)
    pcie["buffers"] = rows
    return replace(plan, resident_units=units.units, resident_params=units.params, gpu_resident=total(state),
                   resident_weights="cast" if units.cast else "copy", gpu_grads=gpu_grads, gpu_weights=weights,
                   process_bytes=plan.process_bytes + (0 if plan.on_gpu else units.bytes), **pcie)


def _head_copy(rows: tuple[Buffer, ...], config: ModelConfig, units: Residency, weights: int
               ) -> tuple[tuple[Buffer, ...], int]:
    """(the rows, the weights' device bytes) with no device copy of a resident head or tied table, bound where it
    lives (WeightSlots.take_whole; cast at each use, its cast stays counted)."""
    layout = planning_layout(config)
    less = (layout.embed.numel if units.embed and config.tie_embeddings else 0) + (layout.head.numel if units.head
                                                                                  else 0)
    if not less or units.cast:
        return rows, weights
    fewer = tuple(replace(b, numel=b.numel - less) if b.name in (HEAD, HEAD_CAST) else b for b in rows)
    return fewer, weights - total(rows, HEAD, HEAD_CAST) + total(fewer, HEAD, HEAD_CAST)


def _with_kept(plan: MemoryPlan, kept: KeptLayers) -> MemoryPlan:
    return replace(plan, kept=kept, process_bytes=plan.process_bytes + (0 if plan.on_gpu else kept.bytes))
