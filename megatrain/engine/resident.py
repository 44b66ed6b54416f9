"""Resident units: the first units in forward order (embedding, layers 0, 1, ...) that live on the executor's device
with their fp32 weights, gradient and AdamW moments, and are updated there by the optimizer workers' own fused AdamW
pass, so they skip PCIe and the CPU pool and train bit for bit as the streamed path.

`load` fills them from the arena and `write_back` copies them there; the bf16 copy or cast:
docs/design.md#resident-units."""

from __future__ import annotations

import math

import torch

from megatrain.config import OptimConfig
from megatrain.engine.grad_egress import GradsOut
from megatrain.engine.optimizer import PIECE_NUMEL, AdamWShard
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.memory.buffers import RESIDENT_COPY, dtype_name, has, resident_buffers
from megatrain.model.layout import ALIGN, ModelLayout, Unit

STATE = ("params", "exp_avg", "exp_avg_sq")  # what load and write_back move (the gradient is the step's own)


class ResidentUnits:
    """The state of the first `count` units of `layout` on `device`, laid out at the arena's offsets from 0."""

    def __init__(self, layout: ModelLayout, count: int, device: torch.device, dtype: torch.dtype, cast: bool = False):
        """dtype: what compute reads; cast: in bf16 runs no bf16 copy, each use casts
        (docs/design.md#resident-units)."""
        self.units = layout.units[:count]
        self.numel = self.units[-1].offset + self.units[-1].numel if self.units else 0
        self.device = device
        # whether compute's weights are cast from the fp32 ones at each use (no bf16 copy)
        self.cast = cast and dtype != torch.float32 and bool(self.units)
        # the rows the memory plan sums (buffers.py): the fp32 state; what compute reads, rewritten by each update
        rows = resident_buffers(self.numel, dtype_name(dtype), cast)
        names = ["grads", *STATE, *([BF16_COPY_SEGMENT] if has(rows, RESIDENT_COPY) else [])]
        self.tensors = dict(zip(names, [t.zero_() for r in rows for t in r.allocate(device)], strict=True))
        self.weights = self.tensors.get(BF16_COPY_SEGMENT, self.tensors["params"])
        self.layout = ModelLayout(layout.config, list(self.units), self.numel)  # the resident units alone
        self.version = 0
        self.in_arena = False  # the arena's ranges hold this state (since a load or write_back, before an update)
        self._adamw: tuple[OptimConfig, AdamWShard] | None = None

    def __len__(self) -> int:
        return len(self.units)

    def holds(self, unit: Unit) -> bool:
        return unit.index < len(self.units)

    def owns(self, t: torch.Tensor) -> bool:
        """`t` is (a view of) resident state: on the device already."""
        ptr = t.untyped_storage().data_ptr()
        return bool(self.units) and any(ptr == x.untyped_storage().data_ptr() for x in self.tensors.values())

    def weights_of(self, unit: Unit) -> torch.Tensor:
        """The unit's weights as compute reads them (compute dtype), flat; where they are cast at each use (`cast`),
        the fp32 weights they are cast from."""
        return unit.range_of(self.weights)

    def grads_of(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Views of the unit's gradient tensors, where its backward writes them."""
        return unit.bind(unit.range_of(self.tensors["grads"]))

    @staticmethod
    def land(out: GradsOut) -> None:
        """A resident unit's gradients, just computed on the compute stream, into its gradient here (on that stream):
        where a gradient is computed in place (the embedding's rows) the scatter writes it."""
        for g, dst in out.pairs:
            if dst.data_ptr() != g.data_ptr():
                dst.copy_(g)
        if out.scatter is not None:
            out.scatter()
        out.pairs.clear()

    def update(self, step: int, clip_coef: float, optim: OptimConfig, units: list[int] | None = None) -> None:
        """Update number `step` (0-based) of the resident units (or of `units` among them: a non-finite one is left)
        with the clip coefficient, as an optimizer worker's pass does it; the state then holds update step + 1."""
        if self._adamw is None or self._adamw[0] != optim:
            # on a GPU one piece per decay group: the pieces exist for the CPU's caches, which are not the GPU's
            piece = PIECE_NUMEL if self.device.type == "cpu" else -(-max(self.numel, 1) // ALIGN) * ALIGN
            self._adamw = optim, AdamWShard(self.layout, self.tensors, optim, 0, 1, piece_numel=piece)
        for index in range(len(self.units)) if units is None else units:
            self._adamw[1].update(index, step, clip_coef)
        self.version, self.in_arena = step + 1, False

    def load(self, arena: dict[str, torch.Tensor], version: int) -> None:
        """The resident state from the arena's ranges of these units (one node's arena: moments at the weights'
        offsets), holding update number `version`."""
        for name in STATE:
            self.tensors[name].copy_(arena[name][: self.numel])
        if BF16_COPY_SEGMENT in self.tensors:
            self.tensors[BF16_COPY_SEGMENT].copy_(self.tensors["params"])  # round to nearest even, as the pass does
        self.tensors["grads"].zero_()
        self.version, self.in_arena = version, True
        self._synchronize()

    def write_back(self, arena: dict[str, torch.Tensor]) -> int:
        """The weights, moments (and bf16 copy of the weights, where the arena has one) into the arena's ranges of
        these units; returns the update count they hold. Nothing is copied where the arena holds them already (no update
        since the last load or write-back: a 7B model's resident state is ~10 s of copies, and `Engine.parameters`,
        save and export each ask)."""
        if self.in_arena:
            return self.version
        for name in STATE:
            arena[name][: self.numel].copy_(self.tensors[name])
        if BF16_COPY_SEGMENT in arena and self.units:
            arena[BF16_COPY_SEGMENT][: self.numel].copy_(self.tensors["params"])
        self._synchronize()
        self.in_arena = True
        return self.version

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def resident_update(resident: list[int], norms_sq: list[float], finite: bool, clip_coef: float, after_step: bool
                    ) -> tuple[float, list[int] | None] | None:
    """What a step's update of the resident units is, as (clip coefficient, units; None: all), or None where there is
    none: with `after_step` (the update waits for the step's norm) all of them with the step's coefficient, if the
    step is finite; else, as each streamed unit's update is final as it lands, those whose gradient is finite."""
    if not resident or not norms_sq:  # none, or no backward (a non-finite loss)
        return None
    if after_step:
        return (clip_coef, None) if finite else None
    units = [u for u in resident if math.isfinite(norms_sq[u])]
    return (1.0, units) if units else None
