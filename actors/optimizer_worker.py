"""Ray shell of one optimizer worker: a process with its own threads, updating its shard of the arena."""

from __future__ import annotations

import torch
import ray

from megatrain.config import ModelConfig, OptimConfig
from megatrain.engine.optimizer import AdamWShard
from megatrain.memory.arena import Arena, ArenaHandle
from megatrain.model.layout import ModelLayout


@ray.remote
class OptimizerWorker:
    def __init__(self, handle: ArenaHandle, config: ModelConfig, optim: OptimConfig, worker: int, num_workers: int,
                 threads: int):
        torch.set_num_threads(threads)  # Ray sets OMP_NUM_THREADS from num_cpus; make torch agree
        self.arena = Arena.open(handle)
        layout = ModelLayout.build(config)
        versions = self.arena.versions.view(len(layout.units), num_workers)
        self.shard = AdamWShard(layout, self.arena.tensors, optim, worker, num_workers, versions)

    def update_unit(self, unit: int, step: int, clip_coef: float = 1.0) -> float:
        """One unit's update (clipping off: called as soon as the unit's gradients have landed)."""
        return self.shard.update(unit, step, clip_coef)

    def apply(self, step: int, clip_coef: float) -> float:
        """All units in forward order (clipping on: called once the global norm is known)."""
        return self.shard.update_all(step, clip_coef)

    def mark_skipped(self, unit: int, step: int) -> None:
        """Leaves `unit` as it is for update `step` (non-finite gradient) without stalling the executor."""
        self.shard.versions[unit, self.shard.worker] = step + 1

    def numel(self) -> int:
        return self.shard.numel
