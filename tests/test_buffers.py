"""One model of a run's bytes (megatrain/memory/buffers.py): the memory plan's lines are sums of the rows that the
store's arena and the executor's device buffers are allocated from. For several settings the arena's actual
segments, the executor's weight buffers (cpu-async: allocated as on a GPU) and its activation checkpoints after a
step equal the plan's (for a LoRA run, on the CPU path the plan is made for)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.engine.executor import Executor
from megatrain.lora.config import LoraConfig
from megatrain.lora.layout import training_layout
from megatrain.memory.arena import BF16_COPY_SEGMENT, FROZEN_SEGMENT
from megatrain.memory.buffers import (
    ARENA,
    D2H,
    DEVICE,
    DEVICE_CHECKPOINTS,
    EMBED_GRAD_ROWS,
    EMBED_ROWS,
    GRADIENT_BUFFERS,
    H2D,
    HEAD,
    HEAD_CAST,
    HEAD_GRADS,
    HOST_GRAD_ROWS,
    HOST_ROWS,
    OFFLOADED_CHECKPOINTS,
    RESIDENT_COPY,
    RESIDENT_STATE,
    STATE_SEGMENTS,
    WEIGHT_BUFFERS,
    WEIGHT_STAGING,
    dtype_name,
    element_size,
    has,
    row,
    total,
)
from megatrain.memory.crossings import LAYER_IN, LAYER_OUT, crossing_bytes
from megatrain.memory.plan import CUDA_CONTEXT, plan_run
from megatrain.memory.post_plan import reference_dtype, with_reference
from megatrain.model.layout import GradLayout
from megatrain.perf.calibrate import Calibration
from megatrain.perf.predict import pipeline, predict, update_times
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
    store = ParameterStore("tiny", StorePlan(WORKERS, plan.grads, plan.bf16_copy_bytes > 0, lora=settings.get("lora"),
                                             lora_base_dtype=settings.get("lora_base_dtype", "bf16"),
                                             reference=reference), verify=False)
    a = store.arena
    # a whole model's plan counts the device's buffers as asynchronous copies need them (cpu-async allocates them as a
    # GPU does); a LoRA run's, off the GPU, as the CPU path's synchronous copies do
    device = "cpu" if "lora" in settings else "cpu-async"
    executor = Executor(config, store.layout, a.params, a.grads, device, settings["precision"],
                        grad_layout=GradLayout.build(store.layout, plan.grads), frozen=a.tensors.get(FROZEN_SEGMENT),
                        bf16_copy=a.tensors.get(BF16_COPY_SEGMENT), resident_units=plan.resident_units,
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
        # the device's lines are sums of its rows (those autograd and the head make: estimates, not checked here)
        assert plan.gpu_total == int(CUDA_CONTEXT) + total(plan.buffers, place=DEVICE) + plan.kept.bytes
    finally:
        executor.close()
        store.close()


# ---- what crosses: the executor's copies under cpu-async against the plan's crossings (megatrain/memory/crossings.py)

def traced(executor: Executor) -> dict[str, int]:
    """Counts the bytes each copy of the executor's simulated streams moves between host and device: on the H2D
    stream the host tensor read, on the D2H stream the host tensor written (a GPU casts on the device first); the
    H2D stream's casts out of the weight staging buffers stay on the device."""
    s, moved = executor.streams, {"h2d": 0, "d2h": 0}
    staging = {t.untyped_storage().data_ptr() for t in executor.slots.staging}
    copy = s.copy

    def traced_copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        assert stream in (s.h2d, s.d2h)
        if stream is s.d2h:
            moved["d2h"] += dst.numel() * dst.element_size()
        elif src.untyped_storage().data_ptr() not in staging:
            moved["h2d"] += src.numel() * src.element_size()
        copy(dst, src, stream)

    s.copy = traced_copy
    return moved


CROSSING = {
    "fp32 arena, 5 layers": dict(precision="fp32", grads="arena", layers=5),
    "bf16 copy, stream": dict(precision="bf16", bf16_copy="keep", grads="stream", clipping=False, layers=4),
    "bf16 no copy, device": dict(precision="bf16", bf16_copy="none", grads="device", layers=4),
    "offloaded checkpoints, 2 micro-batches": dict(precision="fp32", grads="arena", micro_batches=2, layers=4,
                                                   checkpoint_budget=3 * BATCH * SEQ * 64 * 4),
    "per-micro-batch, 3 passes": dict(precision="fp32", grads="arena", micro_batches=3, schedule="per-micro-batch",
                                      layers=5),
    "2 resident units, tied, padding": dict(precision="fp32", grads="arena", resident=2, layers=4, tied=True),
    "lora, bf16 base, per-micro-batch": dict(precision="fp32", lora=LORA, lora_base_dtype="bf16", layers=4,
                                             micro_batches=2, schedule="per-micro-batch"),
    "lora, 2 resident adapters, padding": dict(precision="bf16", lora=LORA, lora_base_dtype="bf16", layers=3,
                                               resident=2),
    "resident embedding, per-micro-batch, padding": dict(precision="bf16", bf16_copy="keep", grads="arena", resident=1,
                                                         layers=3, micro_batches=2, schedule="per-micro-batch"),
}


def crossing_case(settings: dict[str, Any], device: str) -> tuple[Any, Executor, torch.Tensor | None, int,
                                                                   torch.Tensor, torch.Tensor]:
    """(plan, executor on `device`, the frozen base or None, micro-batches, the batch, the gradients' arena) of a
    CROSSING setting, seeded: two devices' cases hold the same weights and tokens (tests/test_gpu.py compares them)."""
    s = dict(settings)
    base = ModelConfig.from_name("tiny")
    config = replace(base, num_layers=s.pop("layers"), tie_embeddings=s.pop("tied", False),
                     pad_token_id=0 if "resident" in s else None)
    k = s.get("micro_batches", 1)
    plan = plan_run(config, BATCH, SEQ, optimizer_workers=WORKERS, on_gpu=False, find_longest=False,
                    tile_tokens=None, **{"checkpoint_budget": None, **s})
    layout = training_layout(config, s.get("lora"))  # a LoRA run's: its adapters, beside the frozen base
    grad_layout = GradLayout.build(layout, plan.grads)
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(layout.numel, generator=gen) * 0.02
    bf16_copy = params.bfloat16() if plan.bf16_copy_bytes else None
    frozen = None if layout.frozen is None else (torch.randn(layout.frozen.numel, generator=gen) * 0.02).bfloat16()
    grads = torch.zeros(grad_layout.numel)
    executor = Executor(config, layout, params, grads, device, s["precision"], grad_layout=grad_layout,
                        bf16_copy=bf16_copy, resident_units=plan.resident_units,
                        checkpoint_budget=plan.checkpoint_budget, frozen=frozen)
    if len(executor.resident):  # their weights from the arena, as the executor's actor loads them
        executor.resident.load({"params": params, "exp_avg": torch.zeros_like(params),
                                "exp_avg_sq": torch.zeros_like(params)}, 0)
    ids = torch.randperm(config.vocab_size, generator=gen)[: BATCH * k * SEQ].reshape(BATCH * k, SEQ)  # distinct
    return plan, executor, frozen, k, ids, grads


@pytest.mark.parametrize("settings", list(CROSSING.values()), ids=list(CROSSING))
def test_the_bytes_a_step_copies_are_the_plans_crossings(settings: dict[str, Any]) -> None:
    """Exact: every byte the executor's streams copy in a step is a row's (the step's distinct tokens as many as the
    plan's bound, min(vocab, tokens)). Not on the streams, so not here: the step's results read at its end (a float64
    norm per unit, the loss) and the rotary tables."""
    plan, executor, frozen, k, ids, _ = crossing_case(settings, "cpu-async:1")
    try:  # (a LoRA run's device rows: its own plan's, lora_plan.py; the crossings alone here)
        moved, made = traced(executor), made_by(executor) if frozen is None else {}
        out = executor.run(ids, micro_batches=k, schedule=plan.schedule, hold_grads=plan.grads == "device",
                           loss_ready=lambda loss: True)
        if out.held:  # every layer's, beside the head's and the embedding's
            made[GRADIENT_BUFFERS].append(len(out.held) - 2)
        executor.send_held(out.held)
        executor.streams.synchronize()
        assert moved == {"h2d": plan.h2d_bytes, "d2h": plan.d2h_bytes}
        assert plan.h2d_bytes == total(plan.buffers, place=H2D) and plan.d2h_bytes == total(plan.buffers, place=D2H)
        for name, found in made.items():  # (elements, dtype) of one, or with held gradients how many layers' there are
            r = row(plan.buffers, name)
            assert found == [(r.numel, r.dtype), r.count][: len(found)], name
        state = [(t.numel(), dtype_name(t.dtype)) for t in executor.resident.tensors.values() if t.numel()]
        assert state == [(r.numel, r.dtype) for r in plan.buffers if r.name in (RESIDENT_STATE, RESIDENT_COPY)
                         for _ in range(r.count)]
        assert plan.gpu_total == int(CUDA_CONTEXT) + total(plan.buffers, place=DEVICE) + plan.kept.bytes
    finally:
        executor.close()


def made_by(executor: Executor) -> dict[str, list[Any]]:
    """What the step makes on the device and in the host buffers, as (elements, dtype) of the largest one of each
    row: a layer's weight gradients (autograd's, summed over micro-batches and passes), the head's, the embedding
    rows gathered and their gradient; the host buffers the rows are gathered in and their gradient lands in."""
    made: dict[str, list[Any]] = {}

    def note(name: str, tensors: list[torch.Tensor]) -> None:
        found = (sum(t.numel() for t in tensors), dtype_name(tensors[0].dtype))
        made[name] = [max(made.get(name, [found])[0], found, key=lambda f: f[0] * element_size(f[1]))]

    def wrap(obj: Any, method: str, seen: Any) -> None:
        inner = getattr(obj, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            seen(result)
            return result

        setattr(obj, method, wrapped)

    # a layer's gradients as they wait to leave (a later pass's: fp32 sums with the earlier passes')
    wrap(executor, "_gradients", lambda out: note(GRADIENT_BUFFERS, [g for g, _ in out.pairs])
         if out.unit.kind == "layer" else None)
    wrap(executor, "_head", lambda out: note(HEAD_GRADS, [*out[1].values(), out[2]]))
    wrap(executor.embedding, "gather", lambda out: note(EMBED_ROWS, [out[0]]))
    wrap(executor.embedding, "grad_rows", lambda rows: note(EMBED_GRAD_ROWS, [rows]))
    slots, whole = executor.slots, {}  # the head's copy (a tied head's: the table's too), and its cast

    def take_whole(unit: Any, inner: Any = slots.take_whole) -> torch.Tensor:
        copy = slots.whole.get(unit.index, (None,))[0]
        cast = inner(unit)
        if executor.resident.holds(unit) and not executor.resident.cast:  # bound where it lives, no copy
            return cast
        whole.setdefault(HEAD, {})[unit.index] = cast if copy is None else copy
        if copy is not None and cast.dtype != copy.dtype:
            whole.setdefault(HEAD_CAST, {})[unit.index] = cast
        note(HEAD, list(whole[HEAD].values()))
        if HEAD_CAST in whole:
            note(HEAD_CAST, list(whole[HEAD_CAST].values()))
        return cast

    slots.take_whole = take_whole
    host = executor.host_buffers._buffers  # a resident embedding's rows take none
    wrap(executor.embedding, "to_arena", lambda out: [note(name, [host[key]]) for name, key in
                                                      ((HOST_ROWS, "rows"), (HOST_GRAD_ROWS, "grad_rows"))
                                                      if key in host])
    return made


def test_the_predictor_times_the_crossings() -> None:
    """The predictor's copies are the crossings' rows at the calibrated rates: the step's in total, one layer's
    weights in and its gradient out unit by unit (7B bf16 on an H100-like machine, 2 resident units)."""
    config = ModelConfig.from_name("7b")
    cal = Calibration(device="FakeGPU", host="h", created=0.0, cores=16, compute_threads=4, h2d_gbps=50.0,
                      d2h_gbps=40.0, memcpy_gbps=10.0, matmul_tflops={"bf16": 800.0}, adamw_gparams={"8": 8.0})
    plan = plan_run(config, 1, 2048, on_gpu=True, gpu_free=79 * 2**30, host_free=125 * 2**30, precision="bf16",
                    optimizer_workers=8, find_longest=False, bf16_copy="keep", resident=2, micro_batches=2)
    pred = predict(plan, config, cal, precision="bf16", optimizer_workers=8)
    assert pred.h2d_s == total(plan.buffers, place=H2D) / 50e9 and pred.d2h_s == total(plan.buffers, place=D2H) / 40e9
    p = pipeline(plan, config, 1.0, 1.0, pred.h2d_s, pred.d2h_s, update_times(plan, cal, 8))
    layer = row(plan.buffers, LAYER_IN)
    assert layer.dtype == "bfloat16" and p.load_s == pytest.approx(crossing_bytes(plan.buffers, LAYER_IN) / 50e9)
    assert p.send_s == pytest.approx(crossing_bytes(plan.buffers, LAYER_OUT) / 40e9)
    assert layer.count == 2 * (config.num_layers - 1) - 2  # layer 0 resident; the top two stay for the backward


@pytest.mark.parametrize("nodes", [2, 3])
def test_each_nodes_moments_are_the_plans(nodes: int) -> None:
    """With several nodes each store keeps its part of every unit's moments, cut on ALIGN boundaries (NodeShard):
    the plan's moment rows are the largest node's, the other rows every node's."""
    config = ModelConfig.from_name("tiny")
    plan = plan_run(config, BATCH, SEQ, optimizer_workers=WORKERS, on_gpu=False, find_longest=False, tile_tokens=None,
                    checkpoint_budget=None, precision="fp32", grads="arena", nodes=nodes)
    planned = {b.name: (b.dtype, b.numel) for b in plan.buffers if b.place == ARENA}
    moments = []
    for node in range(nodes):
        store = ParameterStore("tiny", StorePlan(WORKERS, "arena", nodes=nodes), node=node, verify=False)
        try:
            segments = {name: (dtype, numel) for name, dtype, numel in store.arena.handle.segments}
        finally:
            store.close()
        moments.append(segments.pop("exp_avg")[1])
        assert segments.pop("exp_avg_sq")[1] == moments[-1]
        assert segments == {k: v for k, v in planned.items() if k not in ("exp_avg", "exp_avg_sq")}
    assert max(moments) == planned["exp_avg"][1] == planned["exp_avg_sq"][1]
    assert len(set(moments)) > 1  # tiny's units do not split evenly: the nodes' parts differ
