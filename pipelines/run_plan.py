"""resolve(request, machine) -> RunPlan: every "auto" of a run decided in one place, for the Engine and `megatrain plan`
alike (megatrain/run_plan.py). The decisions: the device, executors, optimizer workers, the LoRA settings, then the
memory plan's (megatrain/memory/plan.py: plan_run, pick_micro_batches: where gradients wait, micro-batches and their
schedule, tiles and the activation checkpoints' budget, the bf16 copy, resident units and their weights, kept
activations), compile, and how the step's update runs."""

from __future__ import annotations

import logging
from dataclasses import replace

from actors.executor import GPU_HOST_THREADS
from megatrain.config import LINK_GBPS, ConfigError, EngineConfig
from megatrain.memory.nvme import resolve_tier
from megatrain.memory.on_device import StepTime
from megatrain.memory.plan import NO_ROOM, MemoryPlan, pick_micro_batches, plan_run
from megatrain.memory.post_plan import with_reference
from megatrain.memory.tier_plan import with_tier
from megatrain.perf.compile_choice import CompileChoice, auto_on_gpu
from megatrain.perf.disk_rates import disk_rates
from megatrain.perf.predict import MAX_CALIBRATED_WORKERS, Choice, auto_optimizer_workers, choose, step_time
from megatrain.run_plan import Machine, Request, RunPlan
from pipelines.cluster import executor_device
from pipelines.lora import lora_settings

log = logging.getLogger(__name__)



def uses_gpu(device: str, has_gpu: bool) -> bool:
    """Whether a run asking for `device` computes on the node's GPU (a GPU Ray does not know of is not used)."""
    if device.startswith("cuda") and not has_gpu:
        raise ConfigError(f"device {device!r} was asked for but the driver's Ray node has no GPU; use "
                          "device='cpu' or 'auto', or start Ray (and the driver) on a machine with one.")
    return (device == "auto" or device.startswith("cuda")) and has_gpu


def resolve(request: Request, machine: Machine) -> RunPlan:
    """The run's plan: what `request` left "auto" decided for `machine`; a setting the machine cannot follow is
    refused in one sentence. Its memory plan (RunPlan.memory) is not checked here: the Engine refuses what does not fit,
    `megatrain plan` reports it. optimizer_workers "auto" on a GPU with a calibration: the fastest predicted settings
    among those left auto (workers, where gradients wait, tiles), planned as the run they stand for. gpu_memory_gib:
    the GPU's free memory taken as at most that much (held_to)."""
    machine = held_to(machine, request.engine.gpu_memory_gib)
    run = resolve_settings(request, machine)
    choice = fastest(request, machine, run)
    if choice is None:
        return run
    tiles = "none" if choice.plan.tile_tokens is None else choice.plan.tile_tokens
    picked = replace(request.engine, optimizer_workers=choice.optimizer_workers, grads=choice.plan.grads,
                     tile_tokens=choice.plan.tile_tokens)
    run = resolve_settings(replace(request, engine=picked), machine)
    note = (f"optimizer_workers auto: {choice.optimizer_workers} per node, grads {choice.plan.grads}, tiles {tiles}: "
            f"the fastest predicted of {choice.tried} settings that fit")
    return replace(run, notes=(note, *run.notes))


def held_to(machine: Machine, gpu_memory_gib: float | None) -> Machine:
    """The machine with its GPU's free memory min(free, the cap) (the cap where free is not known)."""
    if gpu_memory_gib is None:
        return machine
    cap = int(gpu_memory_gib * 2**30)
    return replace(machine, gpu_free=cap if machine.gpu_free is None else min(machine.gpu_free, cap))


def fastest(request: Request, machine: Machine, run: RunPlan) -> Choice | None:
    """optimizer_workers "auto" on a GPU whose calibration is known: the fastest predicted run among the settings left
    auto, 1 .. the node's CPUs workers (None: none fits, or no search). A LoRA run on a GPU is refused: the predictor
    knows a whole model's update."""
    e, cal = request.engine, machine.calibration
    if e.optimizer_workers != "auto" or not run.on_gpu:
        return None
    if run.lora is not None:
        raise ConfigError("--optimizer-workers auto picks settings by the predicted step time of a whole model's "
                          "update, which a LoRA run does not have; give --optimizer-workers a number with --lora.")
    if cal is None:
        return None
    budget = e.checkpoint_budget_gib
    flags = dict(link_gbps=machine.link_gbps or LINK_GBPS, speculate=e.speculate, clip_rate=request.clip_rate,
                 compiled=run.compile)
    return choose(request.config, run.batch, run.seq, cal, optimizer_workers="auto", grads=e.grads,
                  tile_tokens=e.tile_tokens, clipping=run.clipping, precision=e.precision, schedule=e.schedule,
                  checkpoint_budget=budget if budget in ("auto", None) else round(budget * 2**30), flags=flags,
                  resident=e.resident, keep_activations=e.keep_activations, resident_weights=e.resident_weights,
                  name=run.model, bf16_copy=e.bf16_copy, on_gpu=True, gpu_free=machine.gpu_free,
                  micro_batches=run.micro_batches, nodes=run.nodes, executors=run.executors,
                  host_free=machine.host_free, max_workers=min(MAX_CALIBRATED_WORKERS, max(1, int(machine.free_cpus))))


def resolve_settings(request: Request, machine: Machine) -> RunPlan:
    """resolve's plan before the search, each auto decided by its own rule."""
    e, notes = request.engine, []
    lora = lora_settings(request.lora, request.adapter, request.config, e)  # one sentence on a bad setting
    on_gpu = uses_gpu(e.device, machine.has_gpu)
    if e.device.startswith("cuda:") and on_gpu:
        notes.append(f"device {e.device}: the executor computes on the GPU Ray grants it (choose which with "
                     "CUDA_VISIBLE_DEVICES when starting Ray)")
    executors = e.executors if e.executors != "auto" else max(1, machine.gpus) if on_gpu else 1
    world = executors * machine.nodes
    if world > 1 and e.grads not in ("auto", "arena"):
        raise ConfigError(f"{world} executors sum each unit's gradient into slices of the arena: grads must be "
                          f"'arena' (or 'auto'), not {e.grads!r}.")
    workers = e.optimizer_workers
    if workers == "auto":
        workers = auto_optimizer_workers(machine.free_cpus, executors * GPU_HOST_THREADS if on_gpu else 0,
                                         None if on_gpu else machine.calibration)
        notes.append(f"optimizer_workers auto: {workers} per node")
    e = replace(e, executors=executors, optimizer_workers=workers, grads="arena" if world > 1 else e.grads, lora=lora)
    compiled = compile_decision(request, machine, on_gpu)
    memory = memory_plan(request, machine, e, on_gpu, compiled.on)
    if e.reference:  # GRPO's KL reference: the initial weights' segment in the arena (a LoRA run's: its base)
        memory = with_reference(memory, request.config, e.precision)
    more, warnings = memory_notes(e, memory, on_gpu)
    held = int(e.gpu_memory_gib * 2**30) if on_gpu and e.gpu_memory_gib is not None else None
    if held is not None:
        more.append(f"the GPU held to {e.gpu_memory_gib:g} GiB (gpu_memory_gib): the plan fits in it and the "
                    "executor's allocator is capped there")
    clipping = request.optim.clipping
    after_step = clipping or memory.grads == "device" or world > 1
    update = "final" if not after_step else {"off": "serial", "on": "speculative", "auto": "unless-clipped"}[
        e.speculate]
    budget = memory.checkpoint_budget
    return RunPlan(
        model=request.name, device=executor_device(e.device, on_gpu), on_gpu=on_gpu, precision=e.precision,
        nodes=machine.nodes, executors=executors, optimizer_workers=workers, grads=memory.grads,
        micro_batches=memory.micro_batches, batch=memory.batch, seq=memory.seq, schedule=memory.schedule,
        tile_tokens=memory.tile_tokens, checkpoint_budget=budget, resident_units=memory.resident_units,
        resident_weights=memory.resident_weights, kept_layers=len(memory.kept.indices),
        bf16_copy=memory.bf16_copy_bytes > 0, compile=compiled.on, compile_why=compiled.why, update=update,
        clipping=clipping, loss_chunk_tokens=e.loss_chunk_tokens, seed=e.seed, lora=lora,
        lora_base_dtype=e.lora_base_dtype, threads_per_worker=e.threads_per_worker,
        tier=resolve_tier(e.nvme, memory.tier.names if memory.tier else (), memory.resident_units,
                          lora is not None, memory.grads, memory.bf16_copy_bytes > 0),
        arena_bytes=memory.arena_bytes, reference=e.reference and lora is None, gpu_memory=held,
        host_bytes=memory.host_total, gpu_bytes=memory.gpu_total, notes=(*notes, *more), warnings=warnings,
        memory=memory)


def compile_decision(request: Request, machine: Machine, on_gpu: bool) -> CompileChoice:
    """compile "on" / "off" as asked; "auto": eager on the CPU path, else what the GPU's calibration timed faster
    (megatrain/perf/compile_choice.py)."""
    setting = request.engine.compile
    if setting != "auto":
        return CompileChoice(setting == "on", f"layers {'compiled' if setting == 'on' else 'eager'}: "
                                              f"compile = {setting}")
    if not on_gpu:
        return CompileChoice(False, "layers eager: compile = auto runs the CPU path eager (compile = on compiles it)")
    return auto_on_gpu(machine.gpu_name, machine.calibration, request.config, request.engine.precision)


def memory_plan(request: Request, machine: Machine, e: EngineConfig, on_gpu: bool, compiled: bool) -> MemoryPlan:
    """The run's memory plan (plan_run; pick_micro_batches where micro_batches is "auto", the batch then the step's
    rows); e: the request with executors, optimizer workers and the LoRA settings resolved."""
    budget = e.checkpoint_budget_gib
    settings = dict(grads=e.grads, clipping=request.optim.clipping, name=request.name, precision=e.precision,
                    optimizer_workers=e.optimizer_workers, on_gpu=on_gpu, loss_chunk_tokens=e.loss_chunk_tokens,
                    tile_tokens=e.tile_tokens, schedule=e.schedule, nodes=machine.nodes, executors=e.executors,
                    checkpoint_budget=budget if budget in ("auto", None) else round(budget * 2**30),
                    gpu_free=machine.gpu_free if on_gpu else None, host_free=machine.host_free,
                    resident=e.resident, lora=e.lora, lora_base_dtype=e.lora_base_dtype,
                    keep_activations=e.keep_activations, step_time=split_by(request, machine, e, on_gpu, compiled),
                    resident_weights=e.resident_weights, bf16_copy=e.bf16_copy)
    if e.micro_batches == "auto":
        plan = pick_micro_batches(request.config, request.batch, request.seq, **settings)
    else:
        plan = plan_run(request.config, request.batch, request.seq, micro_batches=e.micro_batches, **settings)
    if not e.nvme:
        return plan
    # the NVMe tier's states out of the host's arena (tier_plan.py with_tier: nvme_states auto, the shortest step
    # predicted with the disk as a bound that fits); the fp32 masters only with the bf16 copy that streams instead
    copied = None
    if e.precision == "bf16" and e.bf16_copy == "auto" and e.lora is None and not plan.bf16_copy_bytes:
        copied = plan_run(request.config, plan.batch, request.seq, micro_batches=plan.micro_batches,
                          **{**settings, "bf16_copy": "keep"})
    return with_tier(plan, request.config, e.nvme, e.nvme_states, machine.nvme_gbps or disk_rates(e.nvme),
                     copied=copied, step_time=predictor(request, machine, e, on_gpu, compiled))


def split_by(request: Request, machine: Machine, e: EngineConfig, on_gpu: bool, compiled: bool) -> StepTime | None:
    """What the GPU's spare memory is split by where resident units and kept layers are both "auto" on a GPU: the step
    predicted on the machine's calibration; None without one (the plan then follows on_device.py's rule, and says so),
    or for a LoRA run (the predictor knows a whole model's update)."""
    if not on_gpu or not e.resident == e.keep_activations == "auto":
        return None
    return predictor(request, machine, e, on_gpu, compiled)


def predictor(request: Request, machine: Machine, e: EngineConfig, on_gpu: bool, compiled: bool) -> StepTime | None:
    """The run's step predicted on the machine's calibration (None without one, or for a LoRA run)."""
    cal = machine.calibration
    if cal is None or e.lora is not None:
        return None
    return step_time(request.config, cal, precision=e.precision, optimizer_workers=e.optimizer_workers,
                     clipping=request.optim.clipping, executors=e.executors, speculate=e.speculate,
                     compiled=compiled, link_gbps=machine.link_gbps or LINK_GBPS, clip_rate=request.clip_rate)


def memory_notes(e: EngineConfig, plan: MemoryPlan, on_gpu: bool) -> tuple[list[str], tuple[str, ...]]:
    """What the memory plan decided, for the run's log: (notes, warnings). e: the request, its LoRA settings
    resolved."""
    where = {"arena": "in the host arena", "stream": "in a ring of host slots",
             "device": f"on the {'GPU' if on_gpu else 'executor'} until the step ends"}[plan.grads]
    notes = [f"gradients wait {where}", plan.bf16_copy_note, plan.tier_note, plan.resident_note, plan.kept.describe()]
    warnings = []
    if on_gpu and e.precision == "bf16" and plan.bf16_copy_note.endswith(NO_ROOM) and e.lora is None:
        warnings.append(f"no room on the host for a bf16 copy of the weights ({plan.arena_numel * 2 / 2**30:.1f} GiB): "
                     "fp32 weights cross PCIe and are cast on the GPU, twice the bytes")
    if e.micro_batches == "auto":
        notes.append(f"micro_batches auto: {plan.micro_batches} micro-batch(es) of {plan.batch} rows a step")
    if plan.micro_batches > 1 and plan.schedule == "per-micro-batch" and e.schedule == "auto":
        warnings.append(f"{plan.micro_batches} micro-batches layer-major do not fit memory: the weights stream once "
                        f"per micro-batch ({plan.micro_batches} times a step) and the gradients add up in the arena")
    budget = plan.checkpoint_budget
    if plan.tile_tokens or budget is not None:
        where = ("every activation checkpoint on the device" if budget is None else
                 f"{budget / 2**30:.2f} GiB of activation checkpoints on the device, "
                 f"{plan.host_checkpoints / 2**30:.2f} GiB in host memory")
        notes.append(f"long sequences: {f'{plan.tile_tokens}-token tiles' if plan.tile_tokens else 'untiled'}, {where}")
    return [note for note in notes if note], tuple(warnings)
