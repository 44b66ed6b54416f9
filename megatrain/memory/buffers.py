"""The buffers a run allocates, as one table of named rows (name, place, elements, dtype, count) that the allocators
and the memory plan both read, so that what is planned and what is allocated cannot drift apart:

    arena     the store's shared-memory segments (megatrain/store.py: ParameterStore._allocate), from arena_segments
    device    the executor's weight buffers (megatrain/engine/weight_slots.py), from weight_buffers
    pinned    page-locked host buffers: the offloaded activation checkpoints, as many as device_checkpoints leaves

The memory plan (megatrain/memory/plan.py, lora_plan.py) sums the same rows for its lines, and its PCIe bytes (which
the predictor, megatrain/perf/predict.py, times) take the streamed weights' element size from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.memory.arena import BF16_COPY_SEGMENT, FP32_SEGMENTS, FROZEN_SEGMENT, REFERENCE_SEGMENT
from megatrain.memory.residency import RESIDENT_SEGMENT
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, GradLayout, ModelLayout, aligned_split

ARENA, DEVICE, PINNED = "arena", "device", "pinned"
H2D, D2H = "h2d", "d2h"  # not places: what crosses between them a step, `count` times (megatrain/memory/crossings.py)
# arena segments that hold the run's state (what the plan's arena bytes count); the others are its bookkeeping
STATE_SEGMENTS = (*FP32_SEGMENTS, BF16_COPY_SEGMENT, FROZEN_SEGMENT, REFERENCE_SEGMENT)
WEIGHT_BUFFERS, WEIGHT_STAGING, HEAD, HEAD_CAST = "weight buffers", "weight staging", "head", "head cast"
DEVICE_CHECKPOINTS, CHECKPOINT_TRANSFER = "device checkpoints", "checkpoint transfer"
OFFLOADED_CHECKPOINTS = "offloaded checkpoints"
GRADIENT_BUFFERS, HEAD_GRADS, EMBED_ROWS, EMBED_GRAD_ROWS = ("gradient buffers", "head gradients", "embedding rows",
                                                             "embedding gradient rows")
HOST_ROWS, HOST_GRAD_ROWS = "host embedding rows", "host embedding gradient rows"
LOSS_CHUNK, HEAD_INPUTS, WORKING_SET = "loss chunk", "head inputs", "working set"
RESIDENT_STATE, RESIDENT_COPY = "resident state", "resident bf16 copy"


@dataclass(frozen=True)
class Buffer:
    name: str
    place: str  # ARENA, DEVICE or PINNED (or a crossing: H2D, D2H)
    numel: int  # elements of one
    dtype: str  # a torch dtype's name: "float32", "bfloat16", "int64"
    count: int = 1  # how many alike (the two weight buffers)

    @property
    def nbytes(self) -> int:
        return self.count * self.numel * element_size(self.dtype)

    def allocate(self, device: torch.device | str) -> list[torch.Tensor]:
        """The `count` tensors of this row, uninitialised, on `device`."""
        return [torch.empty(self.numel, device=device, dtype=getattr(torch, self.dtype)) for _ in range(self.count)]


def element_size(dtype: str | torch.dtype) -> int:
    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def arena_segments(numel: int, grads_numel: int, moments_numel: int, *, units: int, columns: int, bf16_copy: bool,
                   frozen_numel: int = 0, frozen_dtype: str = "bfloat16", staging: tuple[Buffer, ...] = (),
                   reference: str | None = None) -> tuple[Buffer, ...]:
    """The arena's segments: fp32 weights (`numel`: what trains, a LoRA run's adapters), gradients and this node's Adam
    moments; the version table (per unit, a column per worker and with several nodes one more), the updates issued
    and the resident flags per unit; the bf16 copy of the weights; the NVMe tier's staging; a LoRA run's frozen base;
    GRPO's KL reference, the initial weights in the `reference` dtype (megatrain/memory/post_plan.py)."""
    sizes = {"params": numel, "grads": grads_numel, "exp_avg": moments_numel, "exp_avg_sq": moments_numel}
    rows = [Buffer(name, ARENA, sizes[name], "float32") for name in FP32_SEGMENTS]
    rows += [Buffer("versions", ARENA, units * columns, "int64"), Buffer("issued", ARENA, units, "int64"),
             Buffer(RESIDENT_SEGMENT, ARENA, units, "int64")]
    rows += [Buffer(BF16_COPY_SEGMENT, ARENA, numel, "bfloat16")] if bf16_copy else []
    rows += list(staging)
    rows += [Buffer(FROZEN_SEGMENT, ARENA, frozen_numel, frozen_dtype)] if frozen_numel else []
    rows += [Buffer(REFERENCE_SEGMENT, ARENA, numel, reference)] if reference is not None else []
    return tuple(rows)


def planned_arena(layout: ModelLayout, num_layers: int, grads: str, workers: int, nodes: int, bf16_copy: bool
                  ) -> tuple[Buffer, ...]:
    """The arena_segments of a model planned from `layout` (a planning layout: one layer where `num_layers` are
    alike): every unit's gradient ("arena") or a ring's the layers share, this node's part of the moments."""
    numel = layout.numel + (num_layers - len(layout.layers)) * layout.max_layer_numel()
    grads_numel = numel if grads == "arena" else GradLayout.ring_numel(layout, num_layers)
    units = len(layout.units) + num_layers - len(layout.layers)
    return arena_segments(numel, grads_numel, node_moments(planned_units(layout, num_layers), nodes), units=units,
                          columns=workers + (nodes > 1), bf16_copy=bf16_copy)


def node_moments(units: list[tuple[int, int]], nodes: int) -> int:
    """Elements of each Adam moment segment on the node that holds the most of them, as the store packs them
    (NodeShard: each unit cut by aligned_split); `units`: (a unit's padded elements, how many units are alike)."""
    def part(numel: int, node: int) -> int:
        lo, hi = aligned_split(numel, node, nodes)
        return hi - lo

    return max(sum(part(numel, node) * count for numel, count in units) for node in range(nodes))


def planned_units(layout: ModelLayout, num_layers: int) -> list[tuple[int, int]]:
    """(elements, how many alike) of each unit of a model planned from `layout` (one layer for `num_layers` alike)."""
    alike = num_layers - len(layout.layers) + 1
    last = layout.layers[-1].index if layout.layers else -1
    return [(u.numel, alike if u.index == last else 1) for u in layout.units]


def weight_buffers(layer_numel: int, head_numel: int, compute: str, streamed: str, staged: bool = True
                   ) -> tuple[Buffer, ...]:
    """The device buffers the weights arrive in: two for the decoder layers to rotate through, in the compute dtype;
    where the streamed weights are of another dtype (fp32 weights of a bf16 run without a bf16 copy, a LoRA run's
    base) and copies are asynchronous (`staged`: a GPU's, or cpu-async), two staging buffers they land in before the
    cast; the head (and a tied head's table) whole, as it crosses (and cast)."""
    cast = staged and streamed != compute
    rows = [Buffer(WEIGHT_BUFFERS, DEVICE, layer_numel, compute, 2)]
    rows += [Buffer(WEIGHT_STAGING, DEVICE, layer_numel, streamed, 2)] if cast else []
    rows += [Buffer(HEAD, DEVICE, head_numel, streamed if cast or staged else compute)]
    rows += [Buffer(HEAD_CAST, DEVICE, head_numel, compute)] if cast else []
    return tuple(rows)


def step_buffers(layout: ModelLayout, layers: int, rows: int, compute: str, streamed: str, *, held: bool,
                 summed: bool) -> tuple[Buffer, ...]:
    """What a step makes on the device besides weights and checkpoints, and the host buffers of the embedding's rows
    (page-locked on a GPU: megatrain/engine/host_buffers.py): the largest layer's weight gradients, GRAD_SETS_IN_FLIGHT
    at once (`held`: all `layers`' until the step ends), in the compute dtype as autograd makes them, fp32 where
    micro-batches are `summed`; the head's in fp32 (a tied head's table too); the `rows` elements of the embedding
    the step gathers, cast to the compute dtype, and their fp32 gradient."""
    tied = layout.embed.slots if all(s.name != "lm_head.weight" for s in layout.head.slots) else ()
    layer = max((sum(s.numel for s in u.slots) for u in layout.layers), default=0)
    head = sum(s.numel for s in (*layout.head.slots, *tied))
    return (Buffer(GRADIENT_BUFFERS, DEVICE, layer, "float32" if summed else compute,
                   layers if held else GRAD_SETS_IN_FLIGHT),
            Buffer(HEAD_GRADS, DEVICE, head, "float32"), Buffer(EMBED_ROWS, DEVICE, rows, compute),
            Buffer(EMBED_GRAD_ROWS, DEVICE, rows, "float32"),
            Buffer(HOST_ROWS, PINNED, rows, streamed), Buffer(HOST_GRAD_ROWS, PINNED, rows, "float32"))


def head_buffers(chunk: int, vocab: int, tokens: int, hidden: int, compute: str, together: int, working: int
                 ) -> tuple[Buffer, ...]:
    """The loss's chunk of `chunk` tokens' logits (fp32: the logits, their softmax and gradient), the `together`
    micro-batches' final hidden states with one gradient being made, and one layer's recompute working set (bytes:
    megatrain/memory/plan_bytes.py, working_bytes): what autograd and the head allocate, not the executor."""
    return (Buffer(LOSS_CHUNK, DEVICE, chunk * vocab, "float32", 3),
            Buffer(HEAD_INPUTS, DEVICE, tokens * hidden, compute, together + 1),
            Buffer(WORKING_SET, DEVICE, working, "uint8"))


def resident_buffers(numel: int, compute: str, cast: bool) -> tuple[Buffer, ...]:
    """The resident units' state on the device (megatrain/engine/resident.py): fp32 gradient, weights, m and v at the
    arena's offsets from 0; in bf16 runs a copy of the weights in the compute dtype, unless cast at each use."""
    copy = numel and compute != "float32" and not cast
    return (Buffer(RESIDENT_STATE, DEVICE, numel, "float32", 4),
            *([Buffer(RESIDENT_COPY, DEVICE, numel, compute)] if copy else []))


def device_checkpoints(entries: int, budget: int | None, size: int) -> int:
    """How many of a step's `entries` activation checkpoints of `size` bytes stay on the device within `budget` (None:
    all); the rest are offloaded to page-locked host buffers (megatrain/engine/activation_checkpoints.py)."""
    return entries if budget is None else min(entries, budget // max(size, 1))


def checkpoint_buffers(numel: int, dtype: str, entries: int, budget: int | None) -> tuple[Buffer, ...]:
    """A step's `entries` activation checkpoints of `numel` elements each: as many as device_checkpoints leaves held on
    the device, the others offloaded to page-locked host buffers, crossing back through two device buffers."""
    on_device = device_checkpoints(entries, budget, numel * element_size(dtype))
    rows = [Buffer(DEVICE_CHECKPOINTS, DEVICE, numel, dtype, on_device)]
    if entries > on_device:
        rows += [Buffer(OFFLOADED_CHECKPOINTS, PINNED, numel, dtype, entries - on_device),
                 Buffer(CHECKPOINT_TRANSFER, DEVICE, numel, dtype, 2)]
    return tuple(rows)


def total(rows: tuple[Buffer, ...], *names: str, place: str | None = None) -> int:
    """Bytes of the rows named (none named: every row), of `place` where given."""
    return sum(r.nbytes for r in rows if (not names or r.name in names) and (place is None or r.place == place))


def row(rows: tuple[Buffer, ...], name: str) -> Buffer:
    """The row named `name` (KeyError where there is none)."""
    for r in rows:
        if r.name == name:
            return r
    raise KeyError(name)


def has(rows: tuple[Buffer, ...], name: str) -> bool:
    return any(r.name == name for r in rows)
