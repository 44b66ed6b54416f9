"""The byte counts of the memory plan (megatrain/memory/plan.py: plan_memory) that follow the executor's schedule:
one layer's recompute working set and the processes' resident memory (what crosses PCIe: crossings.py)."""

from __future__ import annotations

from megatrain.config import ModelConfig

GiB = 2**30
# Resident memory (VmRSS less shared memory) of each process besides the arena. Measured on the CPU path
# (torch 2.13 CPU build, Ray 2.60, `tiny`): every actor and the driver ~0.31 GiB, the executor 0.36, Ray's
# daemons and agents ~0.3, the object store (capped at 256 MiB by init_ray) what it holds. The executor with a
# CUDA context loads the CUDA libraries: an estimate until measured on the GPU machine.
PROCESS_OVERHEAD = {"ray": 0.3 * GiB, "object_store": 0.25 * GiB, "driver": 0.32 * GiB, "store": 0.32 * GiB,
                    "data": 0.32 * GiB, "worker": 0.32 * GiB, "executor_cpu": 0.36 * GiB,
                    "executor_cuda": 1.5 * GiB}


def working_bytes(config: ModelConfig, tokens: int, tile_tokens: int | None, precision: str, layer: int) -> int:
    """One layer's recompute-backward (templates.DecoderLayer.backward): untiled, the whole layer under autograd;
    tiled, the whole sequence's q, k, v, attention output and their gradients, the layer's input, middle and output
    gradients, and one tile's norm, projections and RoPE, or MLP (normed input, gate, up, activation and their
    gradients), under autograd; then the weights' fp32 gradient sums, and the rotary tables."""
    act_bytes = 2 if precision == "bf16" else 4
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.kv_size
    if tile_tokens is None or tile_tokens >= tokens:
        working = tokens * (10 * h + 5 * q + 6 * kv + 6 * f) * act_bytes
    else:
        tile = tile_tokens
        working = tokens * (3 * h + 4 * q + 4 * kv) * act_bytes
        working += max(tile * (4 * h + 2 * q + 4 * kv) * act_bytes + tile * 2 * h * 4,  # fp32 norm inside
                       tile * (3 * h + 6 * f) * act_bytes)
    working += layer * 4 + 2 * tokens * config.head_dim * 4
    if precision != "bf16" and config.num_kv_heads < config.num_heads:  # fp32 GQA: k and v expanded to all heads
        working += 2 * 2 * tokens * (q - kv) * act_bytes
    return working


def process_bytes(optimizer_workers: int, executors: int, on_gpu: bool, pinned: int) -> float:
    """The processes' resident memory besides the arena, and each executor's host buffers (`pinned` bytes, page-locked
    on a GPU: the batch's embedding rows in, their gradient out)."""
    processes = sum(PROCESS_OVERHEAD[k] for k in ("ray", "object_store", "driver", "store", "data"))
    processes += optimizer_workers * PROCESS_OVERHEAD["worker"]
    processes += executors * PROCESS_OVERHEAD["executor_cuda" if on_gpu else "executor_cpu"]
    return processes + executors * pinned


def network_bytes(nodes: int, arena_numel: int) -> int:
    """Between nodes, per step and node: each unit's gradient summed over every executor (gloo's ring all-reduce:
    2 (M-1)/M of it sent; a reduce-scatter, as NCCL does, would send half that), and the other nodes' updated parts
    of the weights broadcast in ((M-1)/M of them)."""
    return int(3 * (nodes - 1) / nodes * arena_numel * 4)
