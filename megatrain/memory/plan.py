"""The memory plan: bytes per tier before anything is allocated, and a clear refusal when it won't fit.

Host: the arena (fp32 params and Adam m and v, 12 B/param; bf16 runs 2 more for the bf16 copy of the weights; plus the
gradients: 4 B/param when they all wait in the arena, a few layers' worth when they stream, see GRAD_PLACEMENTS) and
the processes' resident size (Ray, store, workers, loader, executor). GPU: two weight buffers for the largest decoder
layer, the head, gradient buffers, the activation checkpoints, one layer's recompute working set and one chunk of
logits; then, in what is left, the resident units and the kept activations (megatrain/memory/on_device.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatrain.config import (
    BF16_COPY,
    GRAD_PLACEMENTS,
    SCHEDULES,
    ConfigError,
    MegatrainError,
    ModelConfig,
    check_choice,
)
from megatrain.memory import buffers as bufs
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.memory.copy_rule import BF16_COPY_RULE, pcie_bound
from megatrain.memory.crossings import StepShape, crossings
from megatrain.memory.kept_activations import KeptLayers
from megatrain.memory.lora_plan import lora_memory
from megatrain.memory.on_device import place_on_device
from megatrain.memory.plan_bytes import network_bytes, process_bytes, working_bytes
from megatrain.memory.plan_report import report as plan_report
from megatrain.memory.plan_settings import MemorySettings, RunSettings
from megatrain.memory.tier_plan import TierPlan, nvme_hint
from megatrain.model.layout import planning_layout

GiB = 2**30
CUDA_CONTEXT = 0.6 * GiB


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_available() -> int:
    return _meminfo("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def shm_available(directory: str | Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


@dataclass
class MemoryPlan:
    model: str
    params: int
    arena_numel: int
    arena_bytes: int
    grads: str  # where gradients wait (GRAD_PLACEMENTS, "auto" resolved)
    grads_bytes: int  # the arena's gradient segment, part of arena_bytes
    bf16_copy_bytes: int  # bf16 runs: the bf16 copy of the weights, part of arena_bytes
    process_bytes: int
    gpu_weights: int
    gpu_grads: int
    gpu_checkpoints: int  # device checkpoints: the layer inputs held on the device (at most checkpoint_budget)
    gpu_transfer: int  # the two buffers offloaded checkpoints cross in (0 when none is offloaded)
    gpu_working: int  # one layer's recompute-backward, its MLP over one tile
    gpu_loss: int
    on_gpu: bool
    host_free: int
    shm_free: int
    gpu_free: int | None
    batch: int = 1
    seq: int = 0
    tile_tokens: int | None = None  # the layers' MLP runs over tiles of this many tokens (None: whole)
    checkpoint_budget: int | None = None  # device bytes for checkpoints (None: all of them)
    host_checkpoints: int = 0  # page-locked host buffers of the checkpoints beyond the budget
    longest_seq: int | None = None  # set by plan_run where this one does not fit: the longest that does
    micro_batches: int = 1  # a step's micro-batches of batch x seq tokens
    schedule: str = "layer-major"  # how they meet the weights (megatrain.engine.executor.SCHEDULES)
    h2d_bytes: int = 0  # per step: weights streamed in (forward and backward), embedding rows, checkpoints back
    d2h_bytes: int = 0  # per step: gradients out, offloaded checkpoints out (both: sums of the crossings' rows)
    step: StepShape = StepShape(0)  # what of the step its crossings follow (megatrain/memory/crossings.py)
    nodes: int = 1  # hosts the run spans; every number above is one node's (the batch: one executor's)
    network_bytes: int = 0  # per step, what each node sends (and receives) to the others
    # the first resident_units units (forward order) live on the device with their optimizer state, updated there
    resident_units: int = 0
    resident_params: int = 0
    gpu_resident: int = 0  # their device bytes (on the CPU path part of process_bytes too: the device is the host)
    resident_note: str = ""  # which units and why (Residency.describe)
    resident_weights: str = "copy"  # in bf16 runs compute's weights of them: "copy" kept, or "cast" at each use
    kept: KeptLayers = KeptLayers()  # the top layers that keep their activations, their bytes, why (plan_kept)
    # a LoRA run (megatrain/memory/lora_plan.py): the frozen base's arena bytes (part of arena_bytes) and precision, the
    # adapters' parameters, and each unit's adapter elements in forward order (padded ranges)
    frozen_bytes: int = 0
    frozen_dtype: str = ""
    adapter_params: int = 0
    adapter_numels: tuple[int, ...] = ()
    tier: TierPlan | None = None  # the states kept on NVMe (megatrain/memory/tier_plan.py), out of the arena
    bf16_copy_note: str = ""  # bf16 runs: whether the arena keeps a bf16 copy of the weights, and why (plan_run)
    reference_bytes: int = 0  # GRPO's KL reference: the initial weights' segment, part of arena_bytes (post_plan.py)
    tier_note: str = ""  # nvme_states auto: which states the tier holds, and why (megatrain/memory/tier_plan.py)
    # the rows the byte counts above are sums of, as the store and the executor allocate them (buffers.py)
    buffers: tuple[bufs.Buffer, ...] = ()

    @property
    def arena_host_bytes(self) -> int:
        """What the arena holds in host memory: less what the NVMe tier keeps on disk, plus its staging."""
        return self.arena_bytes - (self.tier.saved_bytes if self.tier is not None else 0)

    @property
    def step_tokens(self) -> int:
        return self.micro_batches * self.batch * self.seq

    @property
    def pcie_bytes_per_token(self) -> float:
        """Host <-> device bytes per trained token: under the layer-major schedule the weights' and gradients' share
        falls as 1 / micro_batches; per micro-batch it does not."""
        return (self.h2d_bytes + self.d2h_bytes) / max(self.step_tokens, 1)

    @property
    def host_total(self) -> int:
        return self.arena_host_bytes + self.process_bytes + self.host_checkpoints

    @property
    def gpu_activations(self) -> int:
        return self.gpu_checkpoints + self.gpu_transfer + self.gpu_working

    @property
    def gpu_total(self) -> int:
        return (int(CUDA_CONTEXT) + self.gpu_weights + self.gpu_grads + self.gpu_activations + self.gpu_loss
                + self.gpu_resident + self.kept.bytes)

    def _shorter(self) -> str:
        if self.longest_seq is None or self.longest_seq >= self.seq:
            return ""
        if self.longest_seq == 0:
            return "; no sequence length fits this batch size here"
        return f"; the longest sequence that fits is {self.longest_seq} tokens (batch {self.batch})"

    @property
    def host_fits(self) -> bool:
        """The arena fits /dev/shm and everything the host holds fits its memory (host_problem says why not)."""
        return self.arena_host_bytes <= self.shm_free and self.host_total <= self.host_free

    def host_problem(self) -> str | None:
        if self.arena_host_bytes > self.shm_free:
            per_param = self.arena_host_bytes / max(self.params, 1)
            return (f"the {self.model} model needs a {self.arena_host_bytes / GiB:.1f} GiB arena ({per_param:.1f} B "
                    f"per parameter for {self.params / 1e9:.2f} G parameters) but /dev/shm has "
                    f"{self.shm_free / GiB:.1f} GiB free; "
                    "enlarge /dev/shm (mount -o remount,size=...), free it (megatrain cleanup)"
                    f"{nvme_hint(self) if self.tier is None else ''}, or pick a smaller model.")
        if self.host_total > self.host_free:
            parts = f"{self.arena_bytes / GiB:.1f} GiB arena + "
            if self.host_checkpoints:
                parts += f"{self.host_checkpoints / GiB:.1f} GiB of offloaded activation checkpoints + "
            fix = (f"a host with {self.host_total / GiB:.0f} GiB available would fit it{self._shorter()}"
                   if self.host_checkpoints else "pick a smaller model or a machine with more memory"
                   + (nvme_hint(self) if self.tier is None else ""))
            return (f"the {self.model} model needs {self.host_total / GiB:.1f} GiB of host memory "
                    f"({parts}{self.process_bytes / GiB:.1f} GiB for processes) but "
                    f"only {self.host_free / GiB:.1f} GiB is available; {fix}.")
        return None

    def gpu_problem(self) -> str | None:
        if self.on_gpu and self.gpu_free is not None and self.gpu_total > self.gpu_free:
            offload = ", with every activation checkpoint in host memory" if self.checkpoint_budget == 0 else ""
            tiles = f" in {self.tile_tokens}-token tiles" if self.tile_tokens else ""
            return (f"training {self.model} on {self.batch} x {self.seq} tokens{tiles}{offload} needs about "
                    f"{self.gpu_total / GiB:.1f} GiB of GPU memory but {self.gpu_free / GiB:.1f} GiB is free; "
                    f"lower the batch size or sequence length{self._shorter()}"
                    + (", or keep fewer units resident." if self.resident_units else "."))
        return None

    def check_host(self) -> None:
        if problem := self.host_problem():
            raise MegatrainError(problem)

    def check(self) -> None:
        problem = self.host_problem() or self.gpu_problem()
        if problem:
            raise MegatrainError(problem)

    def report(self) -> str:
        """What `megatrain plan` prints: each tier's lines, what crosses PCIe, the notes, whether it fits."""
        return plan_report(self)

def plan_memory(config: ModelConfig, batch: int, seq: int, settings: MemorySettings | None = None, **overrides: Any
                ) -> MemoryPlan:
    """The memory plan of one micro-batch of batch x seq tokens with these settings (MemorySettings, its fields the
    keywords, each as the executor and the store take it): bytes per tier, and whether they fit."""
    o = replace(settings or MemorySettings(), **overrides)
    precision, on_gpu, grads, tile_tokens, checkpoint_budget = (o.precision, o.on_gpu, o.grads, o.tile_tokens,
                                                                 o.checkpoint_budget)
    executors, nodes, schedule, host_free, k = o.executors, o.nodes, o.schedule, o.host_free, o.micro_batches
    bf16_copy = precision == "bf16" if o.bf16_copy is None else o.bf16_copy
    check_choice("grads", grads, GRAD_PLACEMENTS)
    grads = "arena" if grads == "auto" else grads
    layout = planning_layout(config)  # one layer's where layers are alike: a config may claim 10^9 of them
    # the arena's gradients: every unit's, or the embedding's and the head's and a ring the layers share
    segments = bufs.planned_arena(layout, config.num_layers, grads, o.optimizer_workers, nodes, bf16_copy)
    arena_numel = bufs.row(segments, "params").numel
    h, v = config.hidden_size, config.vocab_size
    tokens = batch * seq  # of one micro-batch
    together = k if schedule == "layer-major" else 1  # micro-batches whose activations exist at once
    layer = layout.max_layer_numel()
    head = layout.head.numel + (layout.embed.numel if config.tie_embeddings else 0)
    # bf16 runs load the optimizer's bf16 copy of the weights (2 B/param more on the host), or without one
    # cast fp32 weights on the GPU (a fp32 staging buffer beside each bf16 buffer)
    compute = "bfloat16" if precision == "bf16" else "float32"
    streamed = "bfloat16" if precision == "bf16" and bf16_copy else "float32"
    device_weights = bufs.weight_buffers(layer, head, compute, streamed)
    # gradients: a few layers' in flight, or every one until the step ends (grads = device); the embedding's rows
    made = bufs.step_buffers(layout, config.num_layers, min(v, k * tokens) * h, compute, streamed,
                             held=grads == "device", summed=k > 1)
    weights = bufs.total(device_weights) + bufs.total(made, bufs.EMBED_ROWS)
    gpu_grads = bufs.total(made, bufs.GRADIENT_BUFFERS, bufs.HEAD_GRADS, bufs.EMBED_GRAD_ROWS)
    # the layer inputs the backward recomputes from (megatrain/engine/activation_checkpoints.py), one per layer and
    # micro-batch: the top ones held on the device within the budget, the rest offloaded to page-locked host buffers
    checkpoints = bufs.checkpoint_buffers(tokens * h, compute, config.num_layers * together, checkpoint_budget)
    head_rows = bufs.head_buffers(min(tokens, o.loss_chunk_tokens), v, tokens, h, compute, together,
                                  working_bytes(config, tokens, tile_tokens, precision, layer))
    working, loss = bufs.total(head_rows, bufs.WORKING_SET), bufs.total(head_rows, bufs.LOSS_CHUNK, bufs.HEAD_INPUTS)
    processes = process_bytes(o.optimizer_workers, executors, on_gpu, bufs.total(made, place=bufs.PINNED))
    offloaded = next((b for b in checkpoints if b.name == bufs.OFFLOADED_CHECKPOINTS), None)
    step = StepShape(tokens, k, k // together, streamed, executors * nodes, offloaded)
    pcie = crossings(config, layout, step)
    if not on_gpu:  # the CPU path computes in host memory, each executor its own
        processes += executors * (weights + gpu_grads + bufs.total(checkpoints, place=bufs.DEVICE) + working + loss)
    shm_free = shm_available(o.shm_dir) if Path(o.shm_dir).is_dir() else 0
    plan = MemoryPlan(
        model=o.name, params=config.num_params(), arena_numel=arena_numel, nodes=nodes,
        arena_bytes=bufs.total(segments, *bufs.STATE_SEGMENTS), grads=grads, grads_bytes=bufs.total(segments, "grads"),
        network_bytes=network_bytes(nodes, arena_numel), bf16_copy_bytes=bufs.total(segments, BF16_COPY_SEGMENT),
        process_bytes=int(processes), gpu_weights=weights, gpu_grads=gpu_grads, on_gpu=on_gpu,
        gpu_checkpoints=bufs.total(checkpoints, bufs.DEVICE_CHECKPOINTS),
        gpu_transfer=bufs.total(checkpoints, bufs.CHECKPOINT_TRANSFER), gpu_working=working, gpu_loss=loss,
        host_free=host_available() if host_free is None else host_free,
        shm_free=shm_free if host_free is None else host_free, gpu_free=o.gpu_free, batch=batch, seq=seq,
        tile_tokens=tile_tokens, checkpoint_budget=checkpoint_budget,
        host_checkpoints=bufs.total(checkpoints, bufs.OFFLOADED_CHECKPOINTS), micro_batches=k, schedule=schedule,
        h2d_bytes=bufs.total(pcie, place=bufs.H2D), d2h_bytes=bufs.total(pcie, place=bufs.D2H), step=step,
        buffers=(*segments, *device_weights, *made, *checkpoints, *head_rows, *pcie),
    )  # lora: its adapters train beside the frozen base, stored in lora_base_dtype (megatrain/memory/lora_plan.py)
    return plan if o.lora is None else lora_memory(plan, config, o.lora, o.lora_base_dtype, precision, executors)


def resolve_grads(requested: str, *, clipping: bool, device_plan: MemoryPlan | None = None) -> str:
    """The placement of gradients for a run: an explicit choice, checked, or for "auto" the one that keeps the least on
    the host: "stream" without clipping; with clipping "device" when `device_plan` (the plan with grads="device") is for
    a GPU whose free memory is known and fits it; else "arena"."""
    check_choice("grads", requested, GRAD_PLACEMENTS)
    if requested == "stream" and clipping:
        raise ConfigError("grads = 'stream' updates each layer as soon as its gradient lands, before the global "
                          "norm that clipping needs is known; set max_grad_norm = 0, or use grads = 'device' or "
                          "'arena'.")
    if requested != "auto":
        return requested
    if not clipping:
        return "stream"
    fits = (device_plan is not None and device_plan.on_gpu and device_plan.gpu_free is not None
            and device_plan.gpu_problem() is None)
    return "device" if fits else "arena"


AUTO = "auto"
TILE_TOKENS = 8192  # auto tiles once a batch has more tokens than this; smaller tiles where memory is short
MIN_TILE_TOKENS = 1024
LONGEST_SEQ_SEARCHED = 2**24


NO_ROOM = "no room on the host for it"  # why a bf16 run that asked for "auto" has no bf16 copy: a warning
def plan_run(config: ModelConfig, batch: int, seq: int, settings: RunSettings | None = None, **overrides: Any
             ) -> MemoryPlan:
    """plan_one's plan, in bf16 runs with the bf16 copy of the weights (2 B a parameter on the host, half the bytes
    on PCIe) as bf16_copy says: "keep" or "none" as asked; "auto" (BF16_COPY_RULE): the run planned both ways, the copy
    made where only the run with it fits, or where both fit and the fp32 weights' H2D would bound the step without it
    (pcie_bound)."""
    s = replace(settings or RunSettings(), **overrides)
    check_choice("bf16_copy", s.bf16_copy, BF16_COPY)
    if s.precision != "bf16" or s.lora is not None:
        return plan_one(config, batch, seq, s)
    if s.bf16_copy != AUTO:
        plan = plan_one(config, batch, seq, s)
        where = "in the arena" if plan.bf16_copy_bytes else "none"
        return replace(plan, bf16_copy_note=f"bf16 copy of the weights {where}: bf16_copy = {s.bf16_copy}")
    kept, dropped = (plan_one(config, batch, seq, replace(s, bf16_copy=c)) for c in ("keep", "none"))
    fits = [not (p.host_problem() or p.gpu_problem()) for p in (kept, dropped)]
    if fits[0] and fits[1]:
        keep, why = pcie_bound(dropped, config, s)
    else:
        keep, why = fits[0], ("only the run with it fits (the fp32 weights' staging buffers do not fit the GPU)"
                              if fits[0] else NO_ROOM)
    where = "in the arena" if keep else "none"
    return replace(kept if keep else dropped,
                   bf16_copy_note=f"bf16 copy of the weights {where}: {why}; {BF16_COPY_RULE}")


def plan_one(config: ModelConfig, batch: int, seq: int, s: RunSettings) -> MemoryPlan:
    """The plan of the run an Engine starts with these settings, as `megatrain plan` shows it: where gradients wait
    resolved (resolve_grads), in bf16 runs the bf16 copy of the weights as bf16_copy asks ("auto": made only where the
    host has room for it, else fp32 weights cross PCIe and are cast on the GPU), and what was left "auto" picked:

    tile_tokens: untiled up to TILE_TOKENS tokens a batch, else TILE_TOKENS, halved down to MIN_TILE_TOKENS while the
    GPU is short. checkpoint_budget: every checkpoint on the device where they fit (always on the CPU path, whose device
    is the host), else as many as fit beside everything else, the rest offloaded. schedule: "layer-major" where it fits
    (or more than one micro-batch is not asked for), else "per-micro-batch" with the gradients in the arena, where that
    fits. resident: units on the device with their optimizer state (the Engine and `megatrain plan` pass theirs,
    "auto" by default), and keep_activations: the layers that keep activations, in what is left; where both are "auto"
    the split between them is the one `step_time` (a predictor: megatrain/perf/predict.py step_time) predicts shortest,
    or without one a rule's (megatrain/memory/on_device.py); resident_weights: in bf16 runs the resident units' bf16
    weights a bf16 copy or cast at each use, "auto" the shorter predicted with a predictor (else the copy). Where the
    result does not fit, its `longest_seq` says the longest sequence that would (find_longest)."""
    if s.schedule != AUTO:
        check_choice("schedule", s.schedule, SCHEDULES)
    kwargs = dict(name=s.name, precision=s.precision, optimizer_workers=s.optimizer_workers, on_gpu=s.on_gpu,
                  loss_chunk_tokens=s.loss_chunk_tokens, gpu_free=s.gpu_free, host_free=s.host_free,
                  micro_batches=s.micro_batches, schedule="layer-major" if s.schedule == AUTO else s.schedule,
                  nodes=s.nodes, executors=s.executors, lora=s.lora, lora_base_dtype=s.lora_base_dtype,
                  bf16_copy=s.precision == "bf16" and s.bf16_copy != "none")
    grads = s.grads if s.lora is None else "arena"  # a LoRA run's gradients are its adapters': small, in the arena
    if kwargs["schedule"] == "per-micro-batch" and s.micro_batches > 1:
        if grads not in (AUTO, "arena"):
            raise ConfigError(f"the per-micro-batch schedule adds gradients up in the arena: it needs grads = "
                              f"'arena' (or 'auto'), not {grads!r}.")
        grads = "arena"
    tiles = (s.tile_tokens, s.checkpoint_budget)
    device_plan = _plan_sequence(config, batch, seq, "device", *tiles, kwargs) if s.on_gpu else None
    placement = resolve_grads(grads, clipping=s.clipping, device_plan=device_plan)
    plan = _plan_sequence(config, batch, seq, placement, *tiles, kwargs)
    if plan.bf16_copy_bytes and s.bf16_copy == AUTO and plan.host_problem() is not None:
        plan = _plan_sequence(config, batch, seq, placement, *tiles, {**kwargs, "bf16_copy": False})
    if s.schedule == AUTO and s.micro_batches > 1 and grads in (AUTO, "arena") and (
            plan.host_problem() or plan.gpu_problem()):
        fallback = plan_one(config, batch, seq, replace(s, grads="arena", find_longest=False,
                                                        schedule="per-micro-batch"))
        if not (fallback.host_problem() or fallback.gpu_problem()):
            return fallback
    if s.find_longest and (plan.host_problem() or plan.gpu_problem()):
        plan.longest_seq = longest_seq(config, batch, grads=placement, tile_tokens=s.tile_tokens,
                                       checkpoint_budget=s.checkpoint_budget, **kwargs)
    return place_on_device(plan, config, resident=s.resident, keep_activations=s.keep_activations,
                           precision=s.precision, world=s.executors * s.nodes, step_time=s.step_time,
                           resident_weights=s.resident_weights)


def pick_micro_batches(config: ModelConfig, rows: int, seq: int, **plan_kwargs: Any) -> MemoryPlan:
    """The plan of a step of `rows` rows in the fewest equal micro-batches that fit memory (their FLOPs are the same
    whatever the split; fewer passes over the layers, larger matmuls): K the smallest divisor of rows that fits, each
    micro-batch rows / K rows. None fitting: the plan of K = rows (one row each), whose problem says why."""
    plan = None
    for k in (d for d in range(1, rows + 1) if rows % d == 0):
        plan = plan_run(config, rows // k, seq, micro_batches=k, find_longest=False, **plan_kwargs)
        if not (plan.host_problem() or plan.gpu_problem()):
            return plan
    assert plan is not None
    return plan


def _plan_sequence(config: ModelConfig, batch: int, seq: int, grads: str, tile_tokens: int | None | str,
                   checkpoint_budget: int | None | str, kwargs: dict[str, Any]) -> MemoryPlan:
    """The plan with tile_tokens and checkpoint_budget picked where they are "auto"."""
    tokens = batch * seq
    if tile_tokens not in (AUTO, None) and not config.family.tiles:
        raise ConfigError(f"sequence tiling (tile_tokens) is for megatrain's native families; {config.model_type} "
                          "runs on the generic path, whose layers are transformers' own, whole: leave tile_tokens "
                          "unset (auto) for this model.")
    if tile_tokens == AUTO:
        lora = kwargs.get("lora")  # LoRA's dropout cannot run over tiles (adapters.refuse_tiled_dropout)
        untiled = not config.family.tiles or (lora is not None and lora.dropout > 0)
        tiles = [None] if tokens <= TILE_TOKENS or untiled else [
            TILE_TOKENS >> i for i in range((TILE_TOKENS // MIN_TILE_TOKENS).bit_length())]
    else:
        tiles = [tile_tokens]
    gpu_free = kwargs["gpu_free"]
    plan = None
    for tile in tiles:
        plan = plan_memory(config, batch, seq, grads=grads, tile_tokens=tile, checkpoint_budget=None, **kwargs)
        if checkpoint_budget != AUTO:
            plan = plan_memory(config, batch, seq, grads=grads, tile_tokens=tile, checkpoint_budget=checkpoint_budget,
                               **kwargs)
        elif plan.on_gpu and gpu_free is not None and plan.gpu_problem() is not None:
            # keep what fits beside everything else and the two transfer buffers, in whole checkpoints
            checkpoint = plan.gpu_checkpoints // config.num_layers
            room = gpu_free - (plan.gpu_total - plan.gpu_checkpoints) - 2 * checkpoint
            budget = max(0, room) // max(checkpoint, 1) * checkpoint
            plan = plan_memory(config, batch, seq, grads=grads, tile_tokens=tile, checkpoint_budget=budget, **kwargs)
        if plan.gpu_problem() is None:
            break
    assert plan is not None
    return plan


def longest_seq(config: ModelConfig, batch: int, *, grads: str, tile_tokens: int | None | str = AUTO,
                checkpoint_budget: int | None | str = AUTO,
                placed: Callable[[MemoryPlan], MemoryPlan] = lambda plan: plan, **kwargs: Any) -> int:
    """The longest sequence (a multiple of 1024 tokens, or of 128 below that) whose plan fits host and GPU; 0 if none
    does. placed: what the run does to each plan before it is checked (its NVMe tier's states out of the host)."""
    def fits(seq: int, bf16_copy: bool = True) -> bool:
        plan = placed(_plan_sequence(config, batch, seq, grads, tile_tokens, checkpoint_budget,
                                     kwargs if bf16_copy else {**kwargs, "bf16_copy": False}))
        if bf16_copy and plan.bf16_copy_bytes and plan.host_problem() is not None:
            return fits(seq, bf16_copy=False)
        return plan.host_problem() is None and plan.gpu_problem() is None

    if not fits(128):
        return 0
    low, high = 128, 256  # low fits; high is the first length tried that does not
    while high <= LONGEST_SEQ_SEARCHED and fits(high):
        low, high = high, high * 2
    if high > LONGEST_SEQ_SEARCHED:
        return low
    while True:  # bisect to 128 tokens below 8k, 1024 above
        unit = 128 if high <= 8192 else 1024
        mid = (low + high) // 2 // unit * unit
        if mid <= low:
            return low
        low, high = (mid, high) if fits(mid) else (low, mid)


def cap_gpu_memory(cap: int) -> float:
    """Holds this process's CUDA allocator to `cap` bytes less the CUDA context (which the plan counts in the GPU's
    total and the allocator does not): the fraction of the device's memory it is held to."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = max(0.0, min(1.0, (cap - CUDA_CONTEXT) / total))
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def gpu_free_here() -> int | None:
    """Free bytes on this process's GPU (creating a CUDA context), or None without a usable one."""
    try:
        import torch

        return torch.cuda.mem_get_info()[0]
    except Exception:  # no usable GPU here: the plan still reports sizes
        return None
