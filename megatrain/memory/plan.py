"""The memory plan: bytes per tier before anything is allocated, and a clear refusal when it won't fit.

Host: the arena (fp32 params and Adam m and v, 12 B/param; bf16 runs 2 more for the bf16 shadow of the
weights; plus the gradients: 4 B/param when they all wait in the arena, a few layers' worth when they
stream, see GRAD_PLACEMENTS in megatrain/config.py) and the resident size of the processes (Ray,
parameter store, optimizer workers, data loader, executor).
GPU: two weight buffers sized for the largest decoder layer, the head, gradient buffers (all of the
step's gradients when they stay on the device), the layer-input checkpoints, one layer's recompute
working set, and one chunk of logits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from megatrain.config import GRAD_PLACEMENTS, ConfigError, MegatrainError, ModelConfig, check_choice
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, GradLayout, ModelLayout

GiB = 2**30
# Resident memory (VmRSS less shared memory) of each process besides the arena. Measured on the CPU path
# (torch 2.13 CPU build, Ray 2.60, `tiny`): every actor and the driver ~0.31 GiB, the executor 0.36, Ray's
# daemons and agents ~0.3, the object store (capped at 256 MiB by init_ray) what it holds. The executor with a
# CUDA context loads the CUDA libraries: an estimate until measured on the GPU machine.
PROCESS_OVERHEAD = {"ray": 0.3 * GiB, "object_store": 0.25 * GiB, "driver": 0.32 * GiB, "store": 0.32 * GiB,
                    "data": 0.32 * GiB, "worker": 0.32 * GiB, "executor_cpu": 0.36 * GiB,
                    "executor_cuda": 1.5 * GiB}
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
    shadow_bytes: int  # bf16 runs: the bf16 copy of the weights, part of arena_bytes
    process_bytes: int
    gpu_weights: int
    gpu_grads: int
    gpu_activations: int
    gpu_loss: int
    on_gpu: bool
    host_free: int
    shm_free: int
    gpu_free: int | None

    @property
    def host_total(self) -> int:
        return self.arena_bytes + self.process_bytes

    @property
    def gpu_total(self) -> int:
        return int(CUDA_CONTEXT) + self.gpu_weights + self.gpu_grads + self.gpu_activations + self.gpu_loss

    def host_problem(self) -> str | None:
        if self.arena_bytes > self.shm_free:
            per_param = self.arena_bytes / max(self.params, 1)
            return (f"the {self.model} model needs a {self.arena_bytes / GiB:.1f} GiB arena ({per_param:.1f} B per "
                    f"parameter for {self.params / 1e9:.2f} G parameters) but /dev/shm has "
                    f"{self.shm_free / GiB:.1f} GiB free; "
                    "enlarge /dev/shm (mount -o remount,size=...), free it (megatrain cleanup), "
                    "or pick a smaller model.")
        if self.host_total > self.host_free:
            return (f"the {self.model} model needs {self.host_total / GiB:.1f} GiB of host memory "
                    f"({self.arena_bytes / GiB:.1f} GiB arena + {self.process_bytes / GiB:.1f} GiB for processes) but "
                    f"only {self.host_free / GiB:.1f} GiB is available; pick a smaller model or a machine with "
                    "more memory.")
        return None

    def gpu_problem(self) -> str | None:
        if self.on_gpu and self.gpu_free is not None and self.gpu_total > self.gpu_free:
            return (f"training {self.model} needs about {self.gpu_total / GiB:.1f} GiB of GPU memory but "
                    f"{self.gpu_free / GiB:.1f} GiB is free; lower the batch size or sequence length.")
        return None

    def check_host(self) -> None:
        if problem := self.host_problem():
            raise MegatrainError(problem)

    def check(self) -> None:
        problem = self.host_problem() or self.gpu_problem()
        if problem:
            raise MegatrainError(problem)

    def report(self) -> str:
        def row(name: str, n: int) -> str:
            return f"  {name:<34}{n / GiB:>10.2f} GiB"
        size = f"{self.params / 1e9:.3f} G" if self.params >= 1e8 else f"{self.params / 1e6:.3f} M"
        lines = [f"memory plan for {self.model} ({size} params)", "host:"]
        lines += [row("arena: params + Adam m,v (fp32)", self.arena_bytes - self.grads_bytes - self.shadow_bytes)]
        if self.shadow_bytes:
            lines.append(row("arena: bf16 copy of the weights", self.shadow_bytes))
        lines += [row(f"arena: gradients (grads = {self.grads})", self.grads_bytes),
                  row("processes (Ray, actors)", self.process_bytes),
                  row("total", self.host_total), row("available", self.host_free), row("/dev/shm free", self.shm_free)]
        lines += ["gpu:" if self.on_gpu else "compute device (CPU path, shares host memory):"]
        grads_row = "gradients (all, until the step ends)" if self.grads == "device" else "gradient buffers"
        lines += [row("weight buffers (2 layers + head)", self.gpu_weights), row(grads_row, self.gpu_grads),
                  row("activations (checkpoints + 1 layer)", self.gpu_activations), row("loss chunk", self.gpu_loss),
                  row("total (with CUDA context)" if self.on_gpu else "total", self.gpu_total)]
        if self.gpu_free is not None:
            lines.append(row("free", self.gpu_free))
        problem = self.host_problem() or self.gpu_problem()
        lines.append("fits: yes" if problem is None else f"fits: NO: {problem}")
        return "\n".join(lines)


def plan_memory(config: ModelConfig, batch: int, seq: int, *, name: str = "model", precision: str = "tf32",
                optimizer_workers: int = 2, on_gpu: bool = False, loss_chunk_tokens: int = 4096,
                shm_dir: str | Path = "/dev/shm", gpu_free: int | None = None, grads: str = "arena",
                shadow: bool | None = None) -> MemoryPlan:
    """The plan for `grads` placed as given ("auto" is planned as "arena", the most host memory); `shadow`:
    a bf16 copy of the weights in the arena (default: for bf16 runs). gpu_free None: not known (nothing is
    asked of CUDA here, so planning never creates a CUDA context; see gpu_free_here)."""
    shadow = precision == "bf16" if shadow is None else shadow
    check_choice("grads", grads, GRAD_PLACEMENTS)
    grads = "arena" if grads == "auto" else grads
    # Where decoder layers are alike, plan from a one-layer layout, so a config claiming 10^9 layers is refused at
    # once instead of after building a layout of 10^9 units; layers that differ (MoE beside dense layers, hybrid
    # stacks) are planned from the whole layout, sized per structure.
    if config.family.uniform_layers:
        layout = ModelLayout.build(replace(config, num_layers=1))
        arena_numel = layout.numel + (config.num_layers - 1) * layout.max_layer_numel()
    else:
        layout = ModelLayout.build(config)
        arena_numel = layout.numel
    act_bytes = 2 if precision == "bf16" else 4
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    tokens = batch * seq
    layer = layout.max_layer_numel()
    head = layout.head.numel + (layout.embed.numel if config.tie_embeddings else 0)
    embed_rows = min(v, tokens) * h * 4
    # bf16 runs load the optimizer's bf16 shadow of the weights (2 B/param more on the host), or without one
    # cast fp32 weights on the GPU (a fp32 staging buffer beside each bf16 buffer)
    weight_bytes = (2 if shadow else 6) if precision == "bf16" else 4
    weights = (2 * layer + head) * weight_bytes + embed_rows
    if grads == "device":  # every gradient stays until the step ends: layers' in compute dtype, the head's fp32
        gpu_grads = config.num_layers * layer * act_bytes + head * 4 + embed_rows
    else:
        gpu_grads = GRAD_SETS_IN_FLIGHT * layer * 4 + head * 4 + embed_rows
    if grads == "arena":
        grads_numel = arena_numel
    else:  # the embedding and the head keep their own ranges; decoder layers share a ring (GradLayout.ring)
        grads_numel = GradLayout.ring_numel(layout, config.num_layers)
    checkpoints = (config.num_layers + 1) * tokens * h * act_bytes
    # one layer's recompute: normed input, q/k/v, attention out, residual, mlp gate/up/act, and their grads
    working = 2 * tokens * (6 * h + 2 * config.kv_size + 3 * f) * act_bytes
    if precision != "bf16" and config.num_kv_heads < config.num_heads:  # fp32 GQA: k and v expanded to all heads
        working += 2 * 2 * tokens * (config.num_heads * config.head_dim - config.kv_size) * act_bytes
    chunk = min(tokens, loss_chunk_tokens)
    loss = 3 * chunk * v * 4 + 2 * tokens * h * 4
    shadow_bytes = arena_numel * 2 if shadow else 0
    processes = sum(PROCESS_OVERHEAD[k] for k in ("ray", "object_store", "driver", "store", "data"))
    processes += optimizer_workers * PROCESS_OVERHEAD["worker"]
    processes += PROCESS_OVERHEAD["executor_cuda" if on_gpu else "executor_cpu"]
    if on_gpu:  # the executor's page-locked host buffers: the batch's embedding rows in, their gradient out
        processes += 2 * embed_rows
    if not on_gpu:  # the CPU path computes in host memory
        processes += weights + gpu_grads + checkpoints + working + loss
    shm_free = shm_available(shm_dir) if Path(shm_dir).is_dir() else 0
    return MemoryPlan(
        model=name, params=config.num_params(), arena_numel=arena_numel,
        arena_bytes=arena_numel * 12 + grads_numel * 4 + shadow_bytes, grads=grads, grads_bytes=grads_numel * 4,
        shadow_bytes=shadow_bytes,
        process_bytes=int(processes), gpu_weights=weights, gpu_grads=gpu_grads, gpu_activations=checkpoints + working,
        gpu_loss=loss, on_gpu=on_gpu, host_free=host_available(), shm_free=shm_free, gpu_free=gpu_free,
    )


def resolve_grads(requested: str, *, clipping: bool, device_plan: MemoryPlan | None = None) -> str:
    """The placement of gradients for a run: an explicit choice, checked, or for "auto" the one that keeps
    the least on the host: "stream" without clipping; with clipping "device" when `device_plan` (the plan
    with grads="device") is for a GPU whose free memory is known and fits it; else "arena"."""
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


def plan_run(config: ModelConfig, batch: int, seq: int, *, grads: str = "auto", clipping: bool = True,
             name: str = "model", precision: str = "tf32", optimizer_workers: int = 2, on_gpu: bool = False,
             loss_chunk_tokens: int = 4096, gpu_free: int | None = None) -> MemoryPlan:
    """The plan of the run an Engine starts with these settings, as `megatrain plan` shows it: where gradients
    wait resolved (resolve_grads), and in bf16 runs the bf16 copy of the weights kept only where the host has
    room for it (else fp32 weights cross PCIe and are cast on the GPU)."""
    kwargs = dict(name=name, precision=precision, optimizer_workers=optimizer_workers, on_gpu=on_gpu,
                  loss_chunk_tokens=loss_chunk_tokens, gpu_free=gpu_free)
    device_plan = plan_memory(config, batch, seq, grads="device", **kwargs) if on_gpu else None
    plan = plan_memory(config, batch, seq, grads=resolve_grads(grads, clipping=clipping, device_plan=device_plan),
                       **kwargs)
    if plan.shadow_bytes and plan.host_problem() is not None:
        plan = plan_memory(config, batch, seq, grads=plan.grads, shadow=False, **kwargs)
    return plan


def gpu_free_here() -> int | None:
    """Free bytes on this process's GPU (creating a CUDA context), or None without a usable one."""
    try:
        import torch

        return torch.cuda.mem_get_info()[0]
    except Exception:  # no usable GPU here: the plan still reports sizes
        return None
