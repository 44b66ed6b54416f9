"""megatrain.Engine: the driver-side handle on the actors of one training run.

    engine = megatrain.Engine("1b", lr=3e-4, optimizer_workers=8, precision="tf32")
    loss = engine.step(input_ids)             # one optimizer step on this batch
    engine.save_checkpoint("ckpt/step-100")
    engine.shutdown()                          # or use it as a context manager

One step, as the driver sees it:
  1. the executor runs forward + backward; before loading a unit it waits until the previous step's
     update of that unit is in the arena (the workers' version table)
  2. clipping on: the executor returns the per-unit squared gradient norms, the driver turns them into
     one clip coefficient and starts every worker's update in forward order; the call returns at once,
     so the update overlaps the next step's forward
     clipping off: the executor already handed each unit to the workers as its gradients landed
Ray carries only control messages and token batches; weights and gradients stay in the arena.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from actors.executor import GPUExecutor
from actors.optimizer_worker import OptimizerWorker
from actors.parameter_store import ParameterStoreActor
from megatrain.config import EngineConfig, MegatrainError, ModelConfig, OptimConfig
from megatrain.engine.optimizer import clip_coefficient
from megatrain.memory.arena import remove_stale_segments
from megatrain.memory.store import resolve_model

log = logging.getLogger(__name__)


class NonFiniteError(MegatrainError):
    pass


@dataclass
class StepResult:
    step: int  # index of this step (0-based, counting skipped ones)
    loss: float
    tokens: int
    grad_norm: float
    lr: float
    skipped: bool  # non-finite loss or gradient: no update applied
    stats: dict[str, Any] | None = None
    spans: list[Any] = field(default_factory=list)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(np.int64)
    return np.asarray(x, dtype=np.int64)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Joins a running cluster (address="auto") or starts a small local one sized for this machine."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # The object store carries only token batches and control messages: keep it small (it lives in /dev/shm).
    ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=256 * 2**20, include_dashboard=False,
             log_to_driver=True, configure_logging=False)


class Engine:
    def __init__(self, model: str | Path | ModelConfig, *, lr: float = 3e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                 warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.0,
                 optimizer_workers: int = 2, precision: str = "tf32", device: str = "auto", seed: int = 0,
                 loss_chunk_tokens: int = 4096, address: str | None = None, batch_size: int = 8,
                 seq_len: int = 2048, max_nonfinite_steps: int = 5, trace: bool = False):
        self.optim = OptimConfig(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, max_grad_norm=max_grad_norm,
                                 warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
        self.engine_config = EngineConfig(device=device, precision=precision, optimizer_workers=optimizer_workers,
                                          loss_chunk_tokens=loss_chunk_tokens, seed=seed)
        self.config, _, self.model_name = resolve_model(model)
        self.max_nonfinite_steps = max_nonfinite_steps
        self.steps_done = 0  # steps run, skipped ones included
        self.updates_applied = 0  # updates in the arena: AdamW's step count and the LR schedule's index
        self.nonfinite_in_row = 0
        self.skipped_steps = 0
        self._pending: list[ray.ObjectRef] = []
        self._actors: list[Any] = []
        remove_stale_segments()  # a killed earlier run's arena
        init_ray(address)
        try:
            self._start_actors(model, seed, batch_size, seq_len, trace)
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, model: str | Path | ModelConfig, seed: int, batch: int, seq: int, trace: bool) -> None:
        n = self.engine_config.optimizer_workers
        cpus = float(ray.available_resources().get("CPU", os.cpu_count() or 1))
        model_arg = model if isinstance(model, ModelConfig) else str(model)
        self.store = ParameterStoreActor.remote(model_arg, n, seed, batch, seq)
        self._actors.append(self.store)
        self.handle = ray.get(self.store.handle.remote())
        per_worker = max(cpus / n, 0.01) if cpus else 0.01
        threads = max(1, int(per_worker))
        self.workers = [OptimizerWorker.options(num_cpus=min(per_worker, threads), name=None)
                        .remote(self.handle, self.config, self.optim, w, n, threads) for w in range(n)]
        self._actors += self.workers
        on_gpu = self.engine_config.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
        self.executor = GPUExecutor.options(num_gpus=1 if on_gpu else 0).remote(
            self.handle, self.config, self.engine_config, self.workers, self.optim.clipping, trace)
        self._actors.append(self.executor)
        self.device = ray.get(self.executor.device.remote())
        ray.get([w.numel.remote() for w in self.workers])  # all up before the first step

    # ---- training ----
    def step(self, input_ids: Any, labels: Any = None) -> float:
        """One optimizer step on this batch (tensors or numpy [batch, seq]); returns the loss."""
        batch = {"input_ids": _as_numpy(input_ids)}
        if labels is not None:
            batch["labels"] = _as_numpy(labels)
        return self.step_batch(ray.put(batch)).loss

    def step_batch(self, batch: Any) -> StepResult:
        """One step on a batch dict or an ObjectRef to one (e.g. straight from the data-loader actor)."""
        step = self.steps_done
        out = ray.get(self.executor.train_step.remote(batch, self.updates_applied, self.updates_applied,
                                                      self._pending))
        grad_norm = math.sqrt(sum(out["unit_norms_sq"])) if out["unit_norms_sq"] else float("nan")
        finite = math.isfinite(out["loss"]) and math.isfinite(grad_norm) and not out["skipped_units"]
        lr = self.optim.lr_at(self.updates_applied)
        if self.optim.clipping:
            if finite:
                coef = clip_coefficient(grad_norm, self.optim.max_grad_norm)
                self._pending = [w.apply.remote(self.updates_applied, coef) for w in self.workers]
            else:
                self._pending = []
        else:
            self._pending = out["updates"]
        # clipping off: units updated before a non-finite one was found keep their update (see README)
        if finite or (not self.optim.clipping and out["updates"]):
            self.updates_applied += 1
        self.steps_done += 1
        self._count_nonfinite(finite, out["loss"], grad_norm)
        return StepResult(step, out["loss"], out["tokens"], grad_norm, lr, not finite, out["stats"], out["spans"])

    def evaluate(self, batch: Any) -> tuple[float, int]:
        """(mean loss, tokens) of a batch dict or ObjectRef with the current weights; trains nothing."""
        out = ray.get(self.executor.evaluate.remote(batch, self.updates_applied, self._pending))
        return out["loss"], out["tokens"]

    def _count_nonfinite(self, finite: bool, loss: float, grad_norm: float) -> None:
        if finite:
            self.nonfinite_in_row = 0
            return
        self.skipped_steps += 1
        self.nonfinite_in_row += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s; update skipped (%d in a row)",
                    self.steps_done - 1, loss, grad_norm, self.nonfinite_in_row)
        if self.nonfinite_in_row >= self.max_nonfinite_steps:
            raise NonFiniteError(f"{self.nonfinite_in_row} steps in a row had a non-finite loss or gradient; lower "
                                 "the learning rate, check the data, or resume from an earlier checkpoint.")

    def wait_for_updates(self) -> None:
        """Blocks until the last step's update is in the arena (before reading or saving weights)."""
        ray.get(self._pending)
        self._pending = []

    # ---- state ----
    def state(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "updates_applied": self.updates_applied,
                "skipped_steps": self.skipped_steps, "optim": {**self.optim.__dict__, "betas": list(self.optim.betas)}}

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        self.wait_for_updates()
        state = {**self.state(), **(extra_state or {})}
        return Path(ray.get(self.store.save_checkpoint.remote(str(directory), state)))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        self.wait_for_updates()
        state = ray.get(self.store.load_checkpoint.remote(str(directory)))
        self.steps_done = int(state["steps_done"])
        self.updates_applied = int(state["updates_applied"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        return state

    def save_pretrained(self, directory: str | Path, extra_files: list[str | Path] | None = None) -> Path:
        self.wait_for_updates()
        return Path(ray.get(self.store.save_pretrained.remote(str(directory), [str(f) for f in extra_files or []])))

    def parameters(self) -> dict[str, torch.Tensor]:
        """HF name -> copy of the current fp32 weights (maps the arena read-only in this process)."""
        from megatrain.memory.arena import Arena
        from megatrain.model.layout import ModelLayout

        self.wait_for_updates()
        arena = Arena.open(self.handle)
        try:
            return {k: v.clone() for k, v in ModelLayout.build(self.config).hf_views(arena.params).items()}
        finally:
            arena.close()

    def shutdown(self) -> None:
        """Stops the actors; the store unlinks the arena first."""
        try:
            if getattr(self, "store", None) is not None:
                ray.get(self.store.close.remote(), timeout=60)
        except Exception as e:  # the store died: its segments are removed at the next start
            log.warning("parameter store did not close cleanly (%s)", e)
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        self.store = None
        remove_stale_segments()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
