"""RunSettings: the settings megatrain/memory/plan.py's plan_run takes, as one frozen dataclass ("auto" where plan_run
picks); plan_run(config, batch, seq, settings, **overrides)."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.lora.config import LoraConfig
from megatrain.memory.on_device import StepTime

AUTO = "auto"


@dataclass(frozen=True)
class RunSettings:
    """plan_run's settings (its keywords), "auto" where plan_run picks."""

    grads: str = AUTO
    clipping: bool = True
    name: str = "model"
    precision: str = "tf32"
    optimizer_workers: int = 2
    on_gpu: bool = False
    loss_chunk_tokens: int = 4096
    gpu_free: int | None = None
    tile_tokens: int | None | str = AUTO
    checkpoint_budget: int | None | str = AUTO
    host_free: int | None = None
    find_longest: bool = True
    micro_batches: int = 1
    schedule: str = AUTO
    nodes: int = 1
    executors: int = 1
    resident: int | str = "none"
    lora: LoraConfig | None = None
    lora_base_dtype: str = "bf16"
    keep_activations: int | str = "none"
    step_time: StepTime | None = None
    resident_weights: str = AUTO
