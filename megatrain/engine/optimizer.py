"""Sharded AdamW over the arena, in place: the work of one optimizer worker.

Worker w of N owns the w-th contiguous shard of every unit's range. Shard boundaries fall on multiples of
ALIGN elements from the unit start, where torch's fused CPU AdamW gives bit-identical results however a
tensor is split, so the trained weights do not depend on N.

The global gradient norm is not computed here: the executor measures each unit's squared norm on the
device as gradients are produced, and the driver turns their sum into one clip coefficient, the same for
every worker. After updating a unit a worker bumps its entry in the shared `versions` table; the executor
reads that table before it loads a unit's weights for the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatrain.config import OptimConfig
from megatrain.memory.arena import SHADOW_SEGMENT
from megatrain.model.layout import GradLayout, ModelLayout, NodeShard, Unit, aligned_split


def clip_coefficient(grad_norm: float, max_grad_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if not max_grad_norm:
        return 1.0
    return min(1.0, max_grad_norm / (grad_norm + 1e-6))


def shard_bounds(unit: Unit, worker: int, num_workers: int, node: NodeShard | None = None) -> tuple[int, int]:
    """[start, end) of worker's shard within the unit (of the node's part of it), in elements from the unit's
    start."""
    lo, hi = (0, unit.numel) if node is None else node.bounds[unit.index]
    a, b = aligned_split(hi - lo, worker, num_workers)
    return lo + a, lo + b


@dataclass
class _Group:
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    shadow: list[torch.Tensor]  # bf16 copies of params (bf16 runs), rewritten after each update


class AdamWShard:
    """One worker's shard of every unit, updated with torch's fused AdamW kernel."""

    def __init__(self, layout: ModelLayout, tensors: dict[str, torch.Tensor], optim: OptimConfig, worker: int,
                 num_workers: int, versions: torch.Tensor | None = None, grad_layout: GradLayout | None = None,
                 issued: torch.Tensor | None = None, node: NodeShard | None = None):
        """`node`: the part of each unit this node updates, whose moments are packed in `exp_avg`/`exp_avg_sq`
        (several nodes); by default the whole model, moments at the weights' offsets."""
        self.layout, self.optim, self.worker, self.num_workers = layout, optim, worker, num_workers
        self.node = node or NodeShard.build(layout)
        self.versions = versions  # int64 [units, workers], shared
        self.issued = issued  # int64 [units], shared: the update number each unit has been handed out for
        # where each unit's gradient is read from (its slot of a ring, when gradients stream)
        self.grad_layout = grad_layout or GradLayout.full(layout)
        # per unit: (decay group, no-decay group)
        self.groups: list[tuple[_Group, _Group]] = [self._groups(u, tensors) for u in layout.units]
        self.numel = sum(t.numel() for pair in self.groups for grp in pair for t in grp.params)

    def _groups(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> tuple[_Group, _Group]:
        lo, hi = shard_bounds(unit, self.worker, self.num_workers, self.node)
        decay, no_decay = _Group([], [], [], [], []), _Group([], [], [], [], [])
        grads = self.grad_layout.range_of(unit, tensors["grads"])
        shadow = tensors.get(SHADOW_SEGMENT)
        for slot in unit.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a >= b:
                continue
            group = decay if slot.decay else no_decay
            start, end = unit.offset + a, unit.offset + b
            group.params.append(tensors["params"][start:end])
            group.grads.append(grads[a:b])
            group.exp_avg.append(self.node.moments(unit, tensors["exp_avg"], a, b))
            group.exp_avg_sq.append(self.node.moments(unit, tensors["exp_avg_sq"], a, b))
            if shadow is not None:
                group.shadow.append(shadow[start:end])
        return decay, no_decay

    def update(self, unit_index: int, step: int, clip_coef: float = 1.0) -> float:
        """Applies update number `step` (0-based) to this worker's shard of one unit; returns seconds taken."""
        t0 = time.perf_counter()
        lr = self.optim.lr_at(step)
        beta1, beta2 = self.optim.betas
        for group, weight_decay in zip(self.groups[unit_index], (self.optim.weight_decay, 0.0), strict=True):
            if not group.params:
                continue
            if clip_coef < 1.0:
                torch._foreach_mul_(group.grads, clip_coef)
            steps = [torch.tensor(float(step + 1)) for _ in group.params]
            torch._fused_adamw_(group.params, group.grads, group.exp_avg, group.exp_avg_sq, [], steps,
                                lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=self.optim.eps,
                                amsgrad=False, maximize=False)
            for low, param in zip(group.shadow, group.params, strict=False):
                low.copy_(param)  # round to nearest even, as a cast on the GPU would
        if self.versions is not None:
            self.versions[unit_index, self.worker] = step + 1
        return time.perf_counter() - t0

    def queue_depth(self) -> int:
        """Units handed to this worker whose update it has not finished (the one it is on included)."""
        if self.versions is None or self.issued is None:
            return 0
        return int((self.issued > self.versions[:, self.worker]).sum())
