"""Ray shell of the GPU executor: maps and registers the arena, runs the layer-streaming step, and talks
to the optimizer workers (waits for their updates before loading a unit, and, with clipping off, hands
them each unit as soon as its gradients have landed)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray
import torch

from megatrain.config import EngineConfig, ModelConfig
from megatrain.engine.executor import Executor
from megatrain.memory.arena import Arena, ArenaHandle
from megatrain.model.layout import ModelLayout, Unit
from megatrain.telemetry import Recorder

POLL_SECONDS = 0.0005


def _batch_tensors(batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None]:
    # arrays from the object store are read-only views: copy the (small) token ids
    input_ids = torch.from_numpy(np.array(batch["input_ids"], dtype=np.int64))
    labels = batch.get("labels")
    return input_ids, None if labels is None else torch.from_numpy(np.array(labels, dtype=np.int64))


@ray.remote(num_cpus=0)
class GPUExecutor:
    def __init__(self, handle: ArenaHandle, config: ModelConfig, engine: EngineConfig, workers: list[Any],
                 clipping: bool, trace: bool = False):
        self.arena = Arena.open(handle)
        self.layout = ModelLayout.build(config)
        self.executor = Executor(config, self.layout, self.arena.params, self.arena.grads, engine.device,
                                 engine.precision, engine.loss_chunk_tokens, Recorder())
        self.trace = trace  # stall accounting always runs; spans travel to the driver only when tracing
        if self.executor.device.type == "cuda":
            self.arena.register_cuda()
        else:  # the CPU path computes here: use the cores Ray's num_cpus=0 did not grant us
            torch.set_num_threads(max(1, os.cpu_count() or 1))
        self.versions = self.arena.versions.view(len(self.layout.units), len(workers))
        self.workers = workers
        self.clipping = clipping
        self.pending: list[ray.ObjectRef] = []  # update calls this step is waiting on

    def device(self) -> str:
        return str(self.executor.device)

    def pid(self) -> int:
        return os.getpid()

    def train_step(self, batch: dict[str, np.ndarray], step: int, expected_version: int,
                   pending: list[ray.ObjectRef]) -> dict[str, Any]:
        """Forward + backward of `batch` as update number `step`; weights are read only once every worker's
        version of a unit reaches `expected_version` (the previous step's update is in)."""
        self.pending = list(pending)
        issued: list[ray.ObjectRef] = []
        skipped_units: list[int] = []
        rec = self.executor.rec
        rec.begin_step(step, self.executor.device)

        def wait_weights(unit: Unit) -> None:
            self._wait_for_version(unit, expected_version)

        def grads_landed(unit: Unit, norm_sq: float) -> None:
            if self.clipping:
                return  # the update waits for the global norm: the driver starts it after this step
            if np.isfinite(norm_sq):
                issued.extend(w.update_unit.remote(unit.index, step) for w in self.workers)
            else:
                skipped_units.append(unit.index)
                issued.extend(w.mark_skipped.remote(unit.index, step) for w in self.workers)

        def loss_ready(loss: float) -> bool:
            return bool(np.isfinite(loss))

        input_ids, labels = _batch_tensors(batch)
        out = self.executor.run(input_ids, labels, wait_weights, grads_landed, loss_ready)
        stats = rec.end_step()
        self.pending = issued
        return {"loss": out.loss, "tokens": out.tokens, "unit_norms_sq": out.unit_grad_norms_sq,
                "updates": issued, "skipped_units": skipped_units,
                "stats": stats.to_dict(),
                "spans": [s for s in rec.spans if s.step == step] if self.trace else []}

    def evaluate(self, batch: dict[str, np.ndarray], expected_version: int, pending: list[ray.ObjectRef]
                 ) -> dict[str, Any]:
        """Loss of `batch` with the weights of update `expected_version`; no gradients leave the GPU."""
        self.pending = list(pending)
        input_ids, labels = _batch_tensors(batch)
        out = self.executor.run(input_ids, labels, lambda unit: self._wait_for_version(unit, expected_version),
                                loss_ready=lambda loss: False)
        return {"loss": out.loss, "tokens": out.tokens}

    def _wait_for_version(self, unit: Unit, expected_version: int) -> None:
        """Blocks until every worker's update of `unit` reaches `expected_version` (the shared version table),
        looking every 0.1 s whether a worker failed instead."""
        row = self.versions[unit.index]
        if int(row.min()) >= expected_version:
            return
        with self.executor.rec.wait("optimizer", unit.index):
            last_check = time.monotonic()
            while int(row.min()) < expected_version:
                time.sleep(POLL_SECONDS)
                if time.monotonic() - last_check > 0.1:
                    self._raise_failed_updates()
                    last_check = time.monotonic()

    def _raise_failed_updates(self) -> None:
        if not self.pending:
            return
        done, _ = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
        for ref in done:
            ray.get(ref)  # re-raises a worker's failure (RayActorError when it died mid-update)

    def close(self) -> None:
        self.executor.close()
        self.arena.close()
