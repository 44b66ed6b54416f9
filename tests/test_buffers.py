"""One model of a run's bytes (megatrain/memory/buffers.py): the memory plan's lines are sums of the rows that the
store's arena and the executor's device buffers are allocated from. For several settings the arena's actual
segments, the executor's weight buffers (cpu-async: allocated as on a GPU) and its activation checkpoints after a
step equal the plan's (for a LoRA run, on the CPU path the plan is made for)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.engine.executor import Executor
from megatrain.lora.config import LoraConfig
from megatrain.memory.arena import FROZEN_SEGMENT, SHADOW_SEGMENT
from megatrain.memory.buffers import (
    ARENA,
    DEVICE_CHECKPOINTS,
    OFFLOADED_CHECKPOINTS,
    STATE_SEGMENTS,
    WEIGHT_BUFFERS,
    WEIGHT_STAGING,
    has,
    row,
    total,
)
from megatrain.memory.plan import plan_run
from megatrain.memory.post_plan import reference_dtype, with_reference
from megatrain.model.layout import GradLayout
from megatrain.run_plan import StorePlan
from megatrain.store import ParameterStore

BATCH, SEQ, WORKERS = 2, 16, 2
LORA = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
CASES = {
    "fp32 arena": dict(precision="fp32", grads="arena"),
    "bf16 copy, stream": dict(precision="bf16", bf16_copy="keep", grads="stream", clipping=False),
    "bf16 no copy, device": dict(precision="bf16", bf16_copy="none", grads="device"),
    "resident unit, 2 micro-batches offloaded": dict(precision="fp32", grads="arena", resident=1, micro_batches=2,
                                                     checkpoint_budget=3 * BATCH * SEQ * 64 * 4),
    "lora, bf16 base": dict(precision="fp32", lora=LORA, lora_base_dtype="bf16"),
    "bf16 with GRPO's reference": dict(precision="bf16", bf16_copy="keep", grads="arena", reference=True),
}


def built(settings: dict[str, Any]) -> tuple[Any, ParameterStore, Executor]:
    config = ModelConfig.from_name("tiny")
    asked = {k: v for k, v in settings.items() if k != "reference"}
    plan = plan_run(config, BATCH, SEQ, optimizer_workers=WORKERS, on_gpu=False, find_longest=False,
                    tile_tokens=None, **{"checkpoint_budget": None, **asked})
    reference = reference_dtype(settings["precision"]) if settings.get("reference") else None
    if reference is not None:
        plan = with_reference(plan, config, settings["precision"])
    store = ParameterStore("tiny", StorePlan(WORKERS, plan.grads, plan.shadow_bytes > 0, lora=settings.get("lora"),
                                             lora_base_dtype=settings.get("lora_base_dtype", "bf16"),
                                             reference=reference), verify=False)
    a = store.arena
    # a whole model's plan counts the device's buffers as asynchronous copies need them (cpu-async allocates them as a
    # GPU does); a LoRA run's, off the GPU, as the CPU path's synchronous copies do
    device = "cpu" if "lora" in settings else "cpu-async"
    executor = Executor(config, store.layout, a.params, a.grads, device, settings["precision"],
                        grad_layout=GradLayout.build(store.layout, plan.grads), shadow=a.tensors.get(SHADOW_SEGMENT),
                        frozen=a.tensors.get(FROZEN_SEGMENT), resident_units=plan.resident_units,
                        checkpoint_budget=plan.checkpoint_budget)
    return plan, store, executor


@pytest.mark.parametrize("settings", list(CASES.values()), ids=list(CASES))
def test_the_plan_is_what_the_store_and_the_executor_allocate(settings: dict[str, Any]) -> None:
    plan, store, executor = built(settings)
    try:
        arena = tuple((b.name, b.dtype, b.numel) for b in plan.buffers if b.place == ARENA)
        assert store.arena.handle.segments == arena
        assert plan.arena_bytes == total(plan.buffers, *STATE_SEGMENTS) == sum(
            store.arena.tensors[name].nbytes for name, _, _ in arena if name in STATE_SEGMENTS)
        slots = executor.slots
        weights = row(plan.buffers, WEIGHT_BUFFERS)
        assert [(t.numel(), str(t.dtype)) for t in slots.buffers] == [(weights.numel, f"torch.{weights.dtype}")] * 2
        staging = row(plan.buffers, WEIGHT_STAGING) if has(plan.buffers, WEIGHT_STAGING) else None
        assert [(t.numel(), str(t.dtype)) for t in slots.staging] == (
            [] if staging is None else [(staging.numel, f"torch.{staging.dtype}")] * 2)
        k = settings.get("micro_batches", 1)
        ids = torch.randint(0, store.config.vocab_size, (BATCH * k, SEQ))
        executor.run(ids, micro_batches=k)
        checkpoints = executor.activation_checkpoints
        assert checkpoints.peak_device_bytes == plan.gpu_checkpoints == total(plan.buffers, DEVICE_CHECKPOINTS)
        assert checkpoints.host_bytes == plan.host_checkpoints == total(plan.buffers, OFFLOADED_CHECKPOINTS)
    finally:
        executor.close()
        store.close()
