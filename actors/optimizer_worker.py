"""Ray shell of one optimizer worker: a process with its own threads, updating its shard of the arena, and
recording its update times and queue depth as Ray metrics from its own process.

The executor calls `update_unit`, `speculate` or `stow` as gradients land; the driver `apply` and `roll_back` after
the step; resident units are never handed out. Who calls what: docs/design.md#optimizer-workers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import ray
import torch

from actors.arena_handle import HandleArg, open_arena
from actors.metrics import EngineMetrics
from actors.termination import exit_on_sigterm
from megatrain.engine.optimizer import AdamWShard, shard_stager
from megatrain.memory.residency import RESIDENT_SEGMENT
from megatrain.model.layout import GradLayout, ModelLayout, NodeShard
from megatrain.run_plan import WorkerPlan
from megatrain.telemetry import Span, optimizer_lane


@ray.remote
class OptimizerWorker:
    def __init__(self, handle: HandleArg, layout: ModelLayout, plan: WorkerPlan, rank: int,
                 metrics: EngineMetrics | None = None):
        """Worker `rank` of the run `plan` describes (WorkerPlan: its node and its share of each unit there)."""
        exit_on_sigterm()
        node, worker = divmod(rank, plan.workers)
        torch.set_num_threads(plan.threads)  # Ray sets OMP_NUM_THREADS from num_cpus; make torch agree
        self.arena = open_arena(handle)  # waits for the store, which starts beside this actor
        self.layout = layout  # the driver's: building it again would import transformers here for a generic model
        versions = self.arena.versions.view(len(self.layout.units), -1)  # several nodes: a last column, the sync
        part = NodeShard.build(self.layout, node, plan.nodes)
        self.shard = AdamWShard(self.layout, self.arena.tensors, plan.optim, worker, plan.workers, versions,
                                GradLayout.build(self.layout, plan.grads), self.arena.tensors.get("issued"), part,
                                stager=shard_stager(self.layout, self.arena, worker, plan.workers, part))
        self.lane = optimizer_lane(worker, node)
        self.resident = self.arena.tensors.get(RESIDENT_SEGMENT)  # written by the executor once it holds them
        self.worker, self.metrics = worker, metrics

    def _timed(self, unit: int, step: int, work: Callable[[], str | None]) -> list[Span]:
        """`work` on `unit` as a span named by what it did (None: nothing, no span)."""
        depth = self.shard.queue_depth()
        t0 = time.monotonic()
        name = work()
        if name is None:
            return []
        span = Span(self.lane, name, step, t0, time.monotonic(), unit, self.layout.units[unit].numel * 16)
        if self.metrics is not None:
            self.metrics.record_optimizer(self.worker, span.duration, depth)
        return [span]

    def update_unit(self, unit: int, step: int, clip_coef: float = 1.0, speculation: int | None = None
                    ) -> list[Span]:
        """Update number `step` of one unit, settled (AdamWShard.settle: where speculation number `speculation`
        speculated it, that update is confirmed or rolled back and redone clipped)."""
        return self._timed(unit, step, lambda: self.shard.settle(unit, step, clip_coef, speculation))

    def speculate(self, unit: int, step: int, speculation: int, parts: int = 1) -> list[Span]:
        """The update beside the backward of a unit whose gradient landed, once `parts` executors' slices of it have
        (each executor of the node calls this)."""
        return self._timed(unit, step,
                           lambda: "update" if self.shard.speculate(unit, step, speculation, parts) else None)

    def apply(self, step: int, clip_coef: float, speculation: int | None = None) -> list[Span]:
        """All streamed units in forward order, as update_unit (called by the driver once the global norm is known)."""
        units = self._streamed()
        if self.shard.issued is not None:  # every unit is handed out at once (the queue depth metric reads it)
            self.shard.issued[units] = step + 1
        return [span for u in units for span in self.update_unit(u, step, clip_coef, speculation)]

    def _streamed(self) -> list[int]:
        """The units this pool updates: all but those resident on the executor's device."""
        return [u.index for u in self.layout.units if self.resident is None or not self.resident[u.index]]

    def roll_back(self, step: int, speculation: int | None, unit: int | None = None) -> list[Span]:
        """Step `step` is skipped (a non-finite gradient): what speculation number `speculation` speculated is rolled
        back in `unit` (None: every streamed unit); their versions are `step` again."""
        units = self._streamed() if unit is None else [unit]
        roll_back = self.shard.roll_back
        return [span for u in units
                for span in self._timed(u, step, lambda u=u: "roll_back" if roll_back(u, step, speculation) else None)]

    def roll_back_versions(self, step: int) -> None:
        """Every unit's version back to `step`, before clipped updates replace the ones beside the backward."""
        self.shard.roll_back_versions(step)

    def mark_skipped(self, unit: int, step: int) -> list[Span]:
        """Leaves `unit` as it is for update `step` (non-finite gradient) without stalling the executor."""
        self.shard.mark_skipped(unit, step)
        return []

    def stow(self, unit: int, step: int, speculation: int | None, parts: int = 1) -> list[Span]:
        """A unit's gradient landed and waits for the step's norm: the NVMe tier takes this worker's shard of it out of
        the arena, once `parts` executors' slices of it have landed (AdamWShard.stow)."""
        return self._timed(unit, step, lambda: "stow" if self.shard.stow(unit, step, speculation, parts) else None)

    def flush(self) -> None:
        """The NVMe tier's writes behind on disk (before a checkpoint or anything else reads the state files)."""
        self.shard.flush()

    def numel(self) -> int:
        return self.shard.numel

    def pid(self) -> int:
        return os.getpid()
