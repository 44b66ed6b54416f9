"""The flat, layer-contiguous layout of a model's fp32 state.

The model is cut into units, the things that stream (the embedding, each decoder layer, the head); each is one
contiguous range of a flat fp32 buffer whose tensors keep their HF names, at offsets that are multiples of ALIGN
elements (docs/design.md#layout). A `frozen` layout beside it holds what does not train (a LoRA run's base)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from megatrain.config import ModelConfig

ALIGN = 1024  # elements (4 KiB of fp32): unit, tensor and shard boundaries are multiples of this


def _round_up(n: int, multiple: int = ALIGN) -> int:
    return (n + multiple - 1) // multiple * multiple


def aligned_split(numel: int, index: int, count: int) -> tuple[int, int]:
    """[start, end) of part `index` of `count` of a range of `numel` elements (a multiple of ALIGN), cut on ALIGN
    boundaries. Nested splits agree: parts i*k .. (i+1)*k-1 of count*k are together part i of count, so a node's
    executors' gradient slices make up exactly the range that node's optimizer updates."""
    blocks = numel // ALIGN
    return blocks * index // count * ALIGN, blocks * (index + 1) // count * ALIGN


@dataclass(frozen=True)
class TensorSlot:
    name: str  # name inside the unit, e.g. "self_attn.q_proj.weight"
    hf_name: str  # full HF name, e.g. "model.layers.3.self_attn.q_proj.weight"
    offset: int  # elements from the unit's start
    shape: tuple[int, ...]
    decay: bool  # weight decay applies (matrices) or not (norms, biases)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Unit:
    index: int
    kind: str  # "embed" | "layer" | "head"
    offset: int  # elements from the arena's start
    numel: int  # padded size of the range
    slots: tuple[TensorSlot, ...]
    layer: int | None = None  # decoder layer number for kind == "layer"

    def bind(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of this unit's tensors in `flat`, a buffer holding exactly this unit's range."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def range_of(self, arena_flat: torch.Tensor) -> torch.Tensor:
        return arena_flat[self.offset : self.offset + self.numel]


Tensor4 = tuple[str, str, tuple[int, ...], bool]  # (name in its unit, the model's own name, shape, weight-decayed)


def unit_tensors(config: ModelConfig) -> tuple[list[Tensor4], str, list[Tensor4], list[Tensor4]]:
    """The embedding unit's tensors, the decoder layers' name prefix, tensors the first layer's unit holds besides
    the layer's own (what the model runs on the embeddings before it: GPT-2's position embedding), the head unit's
    tensors. A family that names them its own way says so (the generic path: `transformer.h.`, a final norm with a
    bias, an lm_head bias); Llama's names otherwise."""
    own = getattr(config.family, "unit_tensors", None)
    if own is not None:
        return own(config)
    h, v = config.hidden_size, config.vocab_size
    head = [("norm.weight", "model.norm.weight", (h,), False)]
    if not config.tie_embeddings:
        head.append(("lm_head.weight", "lm_head.weight", (v, h), True))
    return [("embed_tokens.weight", "model.embed_tokens.weight", (v, h), True)], "model.layers.", [], head


@dataclass
class ModelLayout:
    config: ModelConfig
    units: list[Unit] = field(default_factory=list)
    numel: int = 0
    # the model's tensors outside the units, kept as stored and written back untrained (a vision tower): HF names
    passthrough: tuple[str, ...] = ()
    # the frozen tensors the units compute with beside their own, unit for unit (same indices and kinds): a LoRA run's
    # base, whose units' own tensors are the adapters (megatrain/lora/layout.py). They stream from a segment of their
    # own in the precision it was loaded in, and have no gradient and no optimizer state. None: every tensor trains.
    frozen: ModelLayout | None = None

    @classmethod
    def build(cls, config: ModelConfig) -> ModelLayout:
        passthrough = getattr(config.family, "passthrough_tensors", None)
        layout = cls(config, passthrough=passthrough(config) if passthrough is not None else ())
        embed, prefix, first, head = unit_tensors(config)
        layout._add("embed", embed)
        for i in range(config.num_layers):
            tensors = config.family.layer_tensors(config, i)
            layout._add("layer", [(name, f"{prefix}{i}.{name}", shape, decay) for name, shape, decay in tensors]
                        + (first if i == 0 else []), layer=i)
        layout._add("head", head)
        return layout

    def _add(self, kind: str, tensors: list[tuple[str, str, tuple[int, ...], bool]], layer: int | None = None) -> None:
        slots, offset = [], 0
        for name, hf_name, shape, decay in tensors:
            slot = TensorSlot(name, hf_name, offset, shape, decay)
            slots.append(slot)
            offset = _round_up(offset + slot.numel)
        unit = Unit(len(self.units), kind, self.numel, offset, tuple(slots), layer)
        self.units.append(unit)
        self.numel += unit.numel

    @property
    def embed(self) -> Unit:
        return self.units[0]

    @property
    def head(self) -> Unit:
        return self.units[-1]

    @property
    def layers(self) -> list[Unit]:
        return self.units[1:-1]

    def max_layer_numel(self) -> int:
        return max((u.numel for u in self.layers), default=0)

    def slots_by_hf_name(self) -> dict[str, tuple[Unit, TensorSlot]]:
        return {s.hf_name: (u, s) for u in self.units for s in u.slots}

    def hf_views(self, arena_flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF name -> view into a full-model flat buffer (params, grads, or an optimizer state)."""
        return {s.hf_name: arena_flat[u.offset + s.offset : u.offset + s.offset + s.numel].view(s.shape)
                for u in self.units for s in u.slots}


def planning_layout(config: ModelConfig) -> ModelLayout:
    """The layout sizes are planned from without building every layer: where the decoder layers are alike
    (family.uniform_layers), a one-layer model's, so a config claiming 10^9 layers is sized at once; where they
    differ (MoE beside dense layers, hybrid stacks), the whole model's."""
    return ModelLayout.build(replace(config, num_layers=1) if config.family.uniform_layers else config)


def planned_unit_numels(config: ModelConfig) -> Iterator[int]:
    """Each unit's elements in forward order (embedding, layers, head), from planning_layout's layout."""
    layout = planning_layout(config)
    if len(layout.layers) == config.num_layers:
        yield from (u.numel for u in layout.units)
        return
    yield layout.embed.numel
    for _ in range(config.num_layers):
        yield layout.max_layer_numel()
    yield layout.head.numel


@dataclass(frozen=True)
class NodeShard:
    """The part of every unit whose Adam moments node `node` of `nodes` keeps and updates (all of it on one node).

    Each node holds the whole fp32 weights (its executors stream them) but only its 1/nodes of each unit's moments,
    packed unit after unit in its `exp_avg`/`exp_avg_sq` segments: 4 + 8/nodes bytes a parameter."""

    node: int
    nodes: int
    bounds: tuple[tuple[int, int], ...]  # per unit: [lo, hi) from the unit's start
    offsets: tuple[int, ...]  # per unit: where its moments start in the node's moment segments
    numel: int  # elements of each moment segment

    @classmethod
    def build(cls, layout: ModelLayout, node: int = 0, nodes: int = 1) -> NodeShard:
        bounds, offsets, total = [], [], 0
        for unit in layout.units:
            lo, hi = aligned_split(unit.numel, node, nodes)
            bounds.append((lo, hi))
            offsets.append(total)
            total += hi - lo
        return cls(node, nodes, tuple(bounds), tuple(offsets), total)

    def overlap(self, unit: Unit, start: int, end: int) -> tuple[int, int] | None:
        """[a, b) of elements [start, end) of `unit` (from its start) that lie in this node's part; None if none do."""
        lo, hi = self.bounds[unit.index]
        a, b = max(lo, start), min(hi, end)
        return (a, b) if a < b else None

    def moments(self, unit: Unit, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The moments of elements [lo, hi) of `unit` (from the unit's start; inside this node's part) in `flat`."""
        start = self.offsets[unit.index] + lo - self.bounds[unit.index][0]
        return flat[start : start + hi - lo]


GRAD_RING_SLOTS = 4  # decoder-layer gradient slots on the host when gradients stream (see GradLayout)
# Decoder-layer gradient sets alive on the device at once, the one being computed included (the memory plan
# counts this many): outside grads = "device" the backward waits before computing a layer's gradients until
# fewer are still on their way to the host (megatrain/engine/grad_egress.py).
GRAD_SETS_IN_FLIGHT = 2


@dataclass(frozen=True)
class GradLayout:
    """Where each unit's gradient lives in the host `grads` segment.

    full: every unit has its own range, at the offsets its weights have (4 B/param more on the host).
    ring: the embedding and the head keep ranges of their own, while the decoder layers share
          `slots` ranges sized for the largest layer, layer l in slot l % slots. A layer's gradient
          may only be written into its slot once the update that read the slot's previous occupant is
          done (the executor waits for it); the host then holds gradients for only a few layers, and its
          total per parameter is params + Adam m + v = 12 B.
    """

    offsets: tuple[int, ...]  # per unit: start of its gradient in the grads segment
    slot_of: tuple[int, ...]  # per unit: id of the range it writes (units sharing an id share the range)
    numel: int

    @classmethod
    def build(cls, layout: ModelLayout, placement: str) -> GradLayout:
        """Full for grads = "arena", a ring for "stream" and "device" (EngineConfig.grads, resolved)."""
        return cls.full(layout) if placement == "arena" else cls.ring(layout)

    @classmethod
    def full(cls, layout: ModelLayout) -> GradLayout:
        return cls(tuple(u.offset for u in layout.units), tuple(u.index for u in layout.units), layout.numel)

    @staticmethod
    def ring_slots(num_layers: int, slots: int = GRAD_RING_SLOTS) -> int:
        return max(1, min(slots, num_layers))

    @classmethod
    def ring_numel(cls, layout: ModelLayout, num_layers: int, slots: int = GRAD_RING_SLOTS) -> int:
        """Size of the ring's grads segment for `num_layers` layers shaped like `layout`'s (which the memory
        plan builds with one layer, so that an absurd layer count costs nothing)."""
        return layout.embed.numel + cls.ring_slots(num_layers, slots) * layout.max_layer_numel() + layout.head.numel

    @classmethod
    def ring(cls, layout: ModelLayout, slots: int = GRAD_RING_SLOTS) -> GradLayout:
        slots = cls.ring_slots(len(layout.layers), slots)
        layer_size = layout.max_layer_numel()
        # embedding, then the ring, then the head; slot ids: embed 0, head 1, layer slots 2..
        ring_start = layout.embed.numel
        head_start = ring_start + slots * layer_size
        offsets, slot_of = [0], [0]
        for unit in layout.layers:
            offsets.append(ring_start + (unit.layer % slots) * layer_size)
            slot_of.append(2 + unit.layer % slots)
        offsets.append(head_start)
        slot_of.append(1)
        return cls(tuple(offsets), tuple(slot_of), cls.ring_numel(layout, len(layout.layers), slots))

    @property
    def full_ranges(self) -> bool:
        """Every unit's gradient has a range of its own (no ring slots shared between layers)."""
        return len(set(self.slot_of)) == len(self.slot_of)

    def range_of(self, unit: Unit, grads_flat: torch.Tensor) -> torch.Tensor:
        start = self.offsets[unit.index]
        return grads_flat[start : start + unit.numel]

    def bind(self, unit: Unit, grads_flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return unit.bind(self.range_of(unit, grads_flat))
