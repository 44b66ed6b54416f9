"""Ray shell of one optimizer worker: a process with its own threads, updating its shard of the arena, and
recording its update times and queue depth as Ray metrics from its own process."""

from __future__ import annotations

import os
import time

import ray
import torch

from actors.metrics import EngineMetrics
from actors.termination import exit_on_sigterm
from megatrain.config import ModelConfig, OptimConfig
from megatrain.engine.optimizer import AdamWShard
from megatrain.memory.arena import Arena, ArenaHandle
from megatrain.model.layout import GradLayout, ModelLayout, NodeShard
from megatrain.telemetry import Span, optimizer_lane


@ray.remote
class OptimizerWorker:
    def __init__(self, handle: ArenaHandle, config: ModelConfig, optim: OptimConfig, worker: int, num_workers: int,
                 threads: int, grads: str = "arena", metrics: EngineMetrics | None = None, node: int = 0,
                 nodes: int = 1):
        """`grads`: where the gradients wait (EngineConfig.grads, resolved), which decides where they are read.
        node, nodes: the worker updates its share of node `node`'s part of each unit (NodeShard)."""
        exit_on_sigterm()
        torch.set_num_threads(threads)  # Ray sets OMP_NUM_THREADS from num_cpus; make torch agree
        self.arena = Arena.open(handle)
        self.layout = ModelLayout.build(config)
        versions = self.arena.versions.view(len(self.layout.units), -1)  # several nodes: a last column, the sync
        self.shard = AdamWShard(self.layout, self.arena.tensors, optim, worker, num_workers, versions,
                                GradLayout.build(self.layout, grads), self.arena.tensors.get("issued"),
                                NodeShard.build(self.layout, node, nodes))
        self.lane = optimizer_lane(worker, node)
        self.worker, self.metrics = worker, metrics

    def _timed_update(self, unit: int, step: int, clip_coef: float) -> Span:
        depth = self.shard.queue_depth()
        t0 = time.monotonic()
        self.shard.update(unit, step, clip_coef)
        span = Span(self.lane, "update", step, t0, time.monotonic(), unit, self.layout.units[unit].numel * 16)
        if self.metrics is not None:
            self.metrics.record_optimizer(self.worker, span.duration, depth)
        return span

    def update_unit(self, unit: int, step: int, clip_coef: float = 1.0) -> list[Span]:
        """One unit's update (clipping off: called as soon as the unit's gradients have landed)."""
        return [self._timed_update(unit, step, clip_coef)]

    def apply(self, step: int, clip_coef: float) -> list[Span]:
        """All units in forward order (clipping on: called once the global norm is known)."""
        if self.shard.issued is not None:  # every unit is handed out at once (the queue depth metric reads it)
            self.shard.issued.fill_(step + 1)
        return [self._timed_update(u.index, step, clip_coef) for u in self.layout.units]

    def mark_skipped(self, unit: int, step: int) -> list[Span]:
        """Leaves `unit` as it is for update `step` (non-finite gradient) without stalling the executor."""
        self.shard.versions[unit, self.shard.worker] = step + 1
        return []

    def numel(self) -> int:
        return self.shard.numel

    def pid(self) -> int:
        return os.getpid()
