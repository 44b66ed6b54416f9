"""The memory plan of an Engine's run, made on the driver before any arena exists: its settings from the run's
EngineConfig, the GPU's free memory measured in a throwaway process (so the driver never holds a CUDA context), the
split of the GPU's spare memory between resident units and kept layers predicted from the device's cached calibration
(the one the progress line's prediction takes, pipelines/plan_prediction.py), and what the plan decided logged
(megatrain/memory/plan.py: plan_run, pick_micro_batches)."""

from __future__ import annotations

import logging
from typing import Any

from actors.executor import gpu_free_memory
from megatrain.config import EngineConfig, ModelConfig, OptimConfig
from megatrain.memory.plan import MemoryPlan, pick_micro_batches, plan_run
from pipelines.plan_prediction import run_step_time
from pipelines.run_actors import get

log = logging.getLogger(__name__)


def run_plan(config: ModelConfig, name: str, e: EngineConfig, optim: OptimConfig, placements: list[Any], batch: int,
             seq: int, on_gpu: bool) -> MemoryPlan:
    """This run's memory plan: where gradients wait, whether a bf16 copy of the weights fits, the tiles and the
    device budget of layer checkpoints, the resident units, the layers that keep activations; a LoRA run's with its
    frozen base and adapters. placements: the run's nodes' (the first's executor measures the GPU). e: its
    optimizer_workers and executors resolved."""
    budget = e.checkpoint_budget_gib
    settings = dict(grads=e.grads, clipping=optim.clipping, name=name, precision=e.precision,
                    optimizer_workers=e.optimizer_workers, on_gpu=on_gpu, loss_chunk_tokens=e.loss_chunk_tokens,
                    tile_tokens=e.tile_tokens, schedule=e.schedule, nodes=len(placements), executors=e.executors,
                    checkpoint_budget=budget if budget in ("auto", None) else round(budget * 2**30),
                    gpu_free=get(gpu_free_memory.options(**placements[0].executor()).remote()) if on_gpu else None,
                    resident=e.resident, lora=e.lora, lora_base_dtype=e.lora_base_dtype,
                    keep_activations=e.keep_activations, step_time=run_step_time(config, e, optim.clipping, on_gpu),
                    resident_weights=e.resident_weights)
    if e.micro_batches == "auto":  # batch: the step's rows
        plan = pick_micro_batches(config, batch, seq, **settings)
    else:
        plan = plan_run(config, batch, seq, micro_batches=e.micro_batches, **settings)
    log.info("gradients wait %s", {"arena": "in the host arena", "stream": "in a ring of host slots",
                                    "device": f"on the {'GPU' if on_gpu else 'executor'} until the step ends"
                                    }[plan.grads])
    log.info("%s", plan.resident_note)
    log.info("%s", plan.kept.describe())
    if on_gpu and e.precision == "bf16" and not plan.shadow_bytes and e.lora is None:
        log.warning("no room on the host for a bf16 copy of the weights (%.1f GiB): fp32 weights cross PCIe "
                    "and are cast on the GPU, twice the bytes", plan.arena_numel * 2 / 2**30)
    return plan
