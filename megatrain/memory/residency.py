"""Which units are resident on the executor's device (megatrain/engine/resident.py holds them): in forward order, the
embedding first, within the bytes the memory plan leaves them, each 16 B a parameter (plus a bf16 copy of its weights
in bf16 runs unless they are cast). None on the CPU path unless asked, none with several executors or nodes
(docs/design.md#resident-units)."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import ConfigError, ModelConfig, check_resident
from megatrain.model.layout import planned_unit_numels

GiB = 2**30
RESIDENT_SEGMENT = "resident"  # the arena's int64 [units]: 1 where a unit is resident (the workers leave it)
MARGIN_BYTES = 2 * GiB  # at least this much of the device stays free: the allocator's slack, compiled kernels' space
MARGIN_FRACTION = 0.1  # ... or this share of its free memory, where that is more


def bytes_per_param(precision: str, cast: bool = False) -> int:
    """Device bytes of a resident parameter: fp32 weight, gradient, m and v; a bf16 copy for compute in bf16 runs,
    unless compute's weights are cast at each use (`cast`)."""
    return 16 + (2 if precision == "bf16" and not cast else 0)


def held_grad_bytes(unit: int, numel: int, total_units: int, precision: str) -> int:
    """Device bytes a streamed unit's gradient takes where gradients wait on the device until the step ends (grads =
    "device", megatrain/memory/plan.py): a decoder layer's in the compute dtype, the head's in fp32; the embedding's
    rows are counted apart. A resident unit's gradient goes into its own fp32 state instead: keeping it frees these."""
    if unit == 0:
        return 0
    return numel * 4 if unit == total_units - 1 or precision != "bf16" else numel * 2


@dataclass(frozen=True)
class Residency:
    """The first `units` units in forward order are resident (0: none)."""

    units: int = 0
    params: int = 0  # their elements (padded ranges)
    bytes: int = 0  # device bytes they take
    layers: int = 0  # decoder layers among them (0 .. layers-1)
    layers_numel: int = 0  # the resident decoder layers' elements
    head_numel: int = 0  # the head's, where it is resident
    total_units: int = 0
    why: str = ""  # one line for the plan's report
    freed_grads: int = 0  # device bytes of held gradients (grads = "device") they no longer take
    cast: bool = False  # bf16 compute casts their fp32 weights at each use: no bf16 copy (bytes_per_param)

    @property
    def embed(self) -> bool:
        """The embedding is among them (it comes first): its rows then never cross PCIe."""
        return self.units > 0

    @property
    def head(self) -> bool:
        """Every unit is resident, the head (the last) too."""
        return 0 < self.units == self.total_units

    def describe(self) -> str:
        if not self.units:
            return f"resident units: none ({self.why})"
        parts = (["the embedding"] if self.embed else []) + (
            ["layer 0" if self.layers == 1 else f"layers 0-{self.layers - 1}"] if self.layers else []) + (
            ["the head"] if self.head else [])
        weights = "; their bf16 weights cast at each use, no bf16 copy" if self.cast else ""
        return (f"resident units: {' + '.join(parts)} ({self.units} of {self.total_units} units, "
                f"{self.params / 1e9:.2f} G params, {self.bytes / GiB:.2f} GiB): updated on the device, no PCIe, no "
                f"CPU pool{weights}; {self.why}")


def held_for_generation(numels: list[int], first: int, budget: int, element_bytes: int, skip: tuple[int, ...] = ()
                        ) -> list[int]:
    """The units a generate call keeps on the device for the whole call, beyond the run's resident ones: from unit
    `first` on in forward order (those in `skip` stream as in a step: an untied embedding, whose rows alone cross), as
    many as `budget` bytes hold at `element_bytes` a weight (weights alone, in the compute dtype: generation takes no
    gradient and no update). Each saves its bytes of PCIe per new token."""
    held, used = [], 0
    for index in range(first, len(numels)):
        if index in skip:
            continue
        if used + numels[index] * element_bytes > budget:
            break
        held.append(index)
        used += numels[index] * element_bytes
    return held


def margin(room: int) -> int:
    """What stays free of `room`, the device bytes the plan leaves beyond the pipeline (MARGIN_*)."""
    return max(MARGIN_BYTES, int(MARGIN_FRACTION * room))


def choose_resident(config: ModelConfig, requested: int | str, *, budget: int | None, on_gpu: bool, precision: str,
                    world: int = 1, held_grads: bool = False, cast: bool = False, summed: bool = False
                    ) -> Residency:
    """The units to make resident: `requested` ("auto", "none" or a count) given `budget`, the device bytes they may
    take, the margin already left (None: not known). world: executors of the run, all nodes'. held_grads: the plan
    holds every gradient on the device until the step ends, so a resident unit costs its held gradient less. cast:
    in bf16 runs their weights are cast at each use, no bf16 copy."""
    check_resident(requested)
    total = config.num_layers + 2
    if not on_gpu and requested in ("auto", "none", 0):
        return Residency(total_units=total, why="the CPU path; ask for a count with resident = N")
    if requested in ("none", 0):
        return Residency(total_units=total, why="resident = none")
    if world > 1:
        if requested != "auto":
            raise ConfigError(f"resident units live on one executor; with {world} executors set resident = none "
                              "(or auto).")
        return Residency(total_units=total, why=f"{world} executors: each would hold its own copy")
    if requested == "auto":
        if budget is None:
            return Residency(total_units=total, why="the GPU's free memory is not known")
        count = None
    else:
        budget, count = None, min(int(requested), total)
    cast = cast and precision == "bf16"
    per_param = bytes_per_param(precision, cast)
    numels: list[int] = []
    cost = freed = 0  # device bytes of the units so far, and of the held gradients they free
    for numel in planned_unit_numels(config):
        # held gradients summed over micro-batches are fp32 (megatrain/engine/layer_passes.py, buffers.step_buffers)
        frees = held_grad_bytes(len(numels), numel, total, "fp32" if summed else precision) if held_grads else 0
        if (count is not None and len(numels) == count) or (
                budget is not None and cost + numel * per_param - frees > budget):
            break
        numels.append(numel)
        cost, freed = cost + numel * per_param - frees, freed + frees
    if not numels:
        return Residency(total_units=total,
                         why="no room on the device beyond the pipeline's buffers and activation checkpoints")
    units, params, head = len(numels), sum(numels), len(numels) == total
    layers = min(units - 1, config.num_layers)
    why = ("the first units the next forward needs, which the CPU pool's update would gate" if requested == "auto"
           else f"resident = {requested}")
    return Residency(units, params, params * per_param, layers, sum(numels[1 : 1 + layers]),
                     numels[-1] if head else 0, total, why, freed, cast)
