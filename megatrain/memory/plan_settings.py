"""MemorySettings and RunSettings: the settings megatrain/memory/plan.py's plan_memory and plan_run take, each as one
frozen dataclass (RunSettings: "auto" where plan_run picks); plan_run(config, batch, seq, settings, **overrides)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatrain.errors import ConfigError
from megatrain.lora.config import LoraConfig
from megatrain.memory.on_device import StepTime

AUTO = "auto"


@dataclass(frozen=True)
class MemorySettings:
    """plan_memory's settings (its keywords): every one as the executor and the store take it."""

    name: str = "model"
    precision: str = "tf32"
    optimizer_workers: int = 2
    on_gpu: bool = False
    loss_chunk_tokens: int = 4096
    shm_dir: str | Path = "/dev/shm"
    gpu_free: int | None = None  # None: not known (planning never creates a CUDA context; plan.gpu_free_here)
    grads: str = "arena"  # as placed ("auto" is planned as "arena", the most host memory)
    bf16_copy: bool | None = None  # a bf16 copy of the weights in the arena (None: for bf16 runs)
    tile_tokens: int | None = None
    checkpoint_budget: int | None = None
    host_free: int | None = None  # the host memory, /dev/shm too, to plan for (None: what this machine has)
    # a step of that many micro-batches; "layer-major": every micro-batch's checkpoints, one's working set, the
    # weights streamed once; "per-micro-batch": one's checkpoints, the weights and gradients once per micro-batch
    micro_batches: int = 1
    schedule: str = "layer-major"
    nodes: int = 1  # hosts, each with the whole weights and 1/nodes of the Adam moments
    executors: int = 1  # per node, each on `batch` rows
    lora: LoraConfig | None = None
    lora_base_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.bf16_copy not in (None, True, False):  # "keep" would read as True: the setting's words are plan_run's
            raise ConfigError(f"plan_memory's bf16_copy is True, False or None (made or not), not {self.bf16_copy!r}; "
                              "bf16_copy = keep | none | auto is plan_run's setting.")


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
    bf16_copy: str = AUTO  # bf16 runs: auto | keep | none (plan.py BF16_COPY)
