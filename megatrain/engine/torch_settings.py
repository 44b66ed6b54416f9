"""Process-wide torch switches the executor sets: the matmul precision, and torch.compile's recompile limit and its
random numbers."""

from __future__ import annotations

import torch

# Batch shapes a compiled decoder layer may see in one process. Each compiles twice (the forward without grad,
# the recompute with it), three times with micro-batches (their gradients folded: megatrain/engine/grad_fold.py);
# past torch's default limit of 8 compilations a fullgraph=True function raises.
COMPILED_SHAPES_LIMIT = 32


def set_matmul_precision(precision: str) -> None:
    """tf32 for "tf32" and "bf16" (whose fp32 parts may use it), strict fp32 IEEE matmuls for "fp32".

    Through torch.set_float32_matmul_precision, which keeps torch's legacy flags (`allow_tf32`) and its
    per-backend ones (`fp32_precision`, torch >= 2.9) in agreement: setting either kind alone leaves a
    state in which torch.get_float32_matmul_precision() raises ("mix of the legacy and new APIs"), and
    torch.compile's autotuning and transformers read it. Call it in a process that computes on the GPU:
    it also lets oneDNN use reduced precision for the CPU's fp32 matmuls."""
    torch.set_float32_matmul_precision("highest" if precision == "fp32" else "high")


def allow_recompiles(shapes: int) -> None:
    """Lets torch.compile'd functions compile for `shapes` batch shapes (torch._dynamo's recompile limit,
    named cache_size_limit before torch 2.6), never lowering a limit set higher elsewhere."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 2 * shapes))


def compile_random_ops_as_eager() -> None:
    """Compiled graphs draw their random numbers as eager does (inductor's fallback_random): the same dropout masks
    from the same generator state. A layer's recompute replays its forward's RNG state, and a compiled layer must give
    the eager one's masks: inductor's own Philox kernels draw other numbers from the same seed (a Phi-3 with dropout,
    compiled on CUDA, was 1.5% off its eager loss). Models without dropout compile exactly as before."""
    import torch._inductor.config

    torch._inductor.config.fallback_random = True
