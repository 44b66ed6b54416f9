"""EngineOptions: everything an Engine is made with besides its model, as one dataclass: the optimizer's settings
(OptimConfig), the engine's (EngineConfig, its "auto"s decided by pipelines/run_plan.py: resolve), and the run's own
(the Ray cluster, the step's shape, recovery, telemetry). `Engine(model, options, **overrides)`; what each setting
means: docs/design.md."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from megatrain.config import ConfigError, EngineConfig, OptimConfig


@dataclass
class EngineOptions:
    # optimizer (OptimConfig)
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    # engine (EngineConfig)
    optimizer_workers: int | str = 2
    precision: str = "tf32"
    device: str = "auto"
    seed: int = 0
    loss_chunk_tokens: int = 4096
    grads: str = "auto"
    compile: str | bool = "auto"
    tile_tokens: int | None | str = "auto"
    checkpoint_budget_gib: float | None | str = "auto"
    micro_batches: int | str = 1
    schedule: str = "auto"
    executors: int | str = "auto"
    nodes: int = 1
    speculate: str = "auto"
    resident: int | str = "auto"
    lora_base_dtype: str = "bf16"
    keep_activations: int | str = "auto"
    resident_weights: str = "auto"
    bf16_copy: str = "auto"
    gpu_memory_gib: float | None = None  # the GPU held to this many GiB (plan and allocator)
    nvme: str | Path | None = None
    nvme_states: Any = "auto"
    reference: bool = False  # the initial weights kept for Engine.logprobs(reference=True) (GRPO's KL reference)
    # the run
    address: str | None = None  # the Ray cluster (pipelines/cluster.py: init_ray)
    batch_size: int = 8  # the step's shape the memory plan is made for
    seq_len: int = 2048
    max_nonfinite_steps: int = 5
    max_restarts: int = 10
    max_replay_steps: int = 1000  # batches kept since the last checkpoint for exact recovery
    resource_timeout: float = 60.0  # seconds to wait for Ray to grant the run's CPUs (and GPU)
    trace: bool = False
    metrics: bool = True
    lora: Any = None  # a LoraConfig, its command-line form or a table of it
    adapter: str | Path | None = None  # a PEFT adapter directory to start from

    @classmethod
    def of(cls, options: EngineOptions | None, overrides: dict[str, Any]) -> EngineOptions:
        """`options` (default: the defaults) with `overrides`; an unknown name is refused in one sentence."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"Engine got unknown setting(s) {', '.join(unknown)}; the settings are the fields of "
                              "pipelines/engine_options.py: EngineOptions.")
        return replace(options or cls(), **overrides)

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps,
                           max_grad_norm=self.max_grad_norm, warmup_steps=self.warmup_steps,
                           total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio)

    def engine(self) -> EngineConfig:
        """What the engine was asked for (its "auto"s left to resolve)."""
        names = {f.name for f in fields(EngineConfig)} & {f.name for f in fields(self)}
        values = {name: getattr(self, name) for name in names}
        return EngineConfig(**{**values, "nvme": self.nvme and str(self.nvme)})
