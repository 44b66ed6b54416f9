"""Measurements of this machine: host <-> GPU copy rates from the arena, and the fused AdamW kernel's speed.

`megatrain doctor` runs them small; benchmarks/pcie.py and benchmarks/optimizer.py run them at full size and
print tables. A plan that predicts step times would calibrate itself with the same functions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatrain.config import ModelConfig, OptimConfig
from megatrain.memory.arena import Arena
from megatrain.model.layout import ModelLayout

# ---- host <-> GPU copies ----


@dataclass
class CopyRates:
    """GB/s (10^9 B/s) of each timed copy; `both` is an H2D and a D2H at once on two streams (the executor's
    backward), counting the bytes of both; empty when not measured."""

    h2d: list[float]
    d2h: list[float]
    both: list[float] = field(default_factory=list)


def timed_rates(copy: Callable[[], None], nbytes: int, repeats: int) -> list[float]:
    """GB/s of `repeats` runs of copy(), each timed on the host clock between two synchronisations, after
    one untimed run (first touch, stream creation)."""
    copy()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def copy_rates(src: torch.Tensor, dst: torch.Tensor, repeats: int, both: bool = True) -> CopyRates:
    """H2D from host tensor `src`, D2H into host tensor `dst` (of equal size), and with `both` the two at once."""
    gpu_in, gpu_out = torch.empty_like(src, device="cuda"), torch.empty_like(dst, device="cuda")
    gpu_out.fill_(1)
    nbytes = src.numel() * src.element_size()
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        with torch.cuda.stream(h2d_stream):
            gpu_in.copy_(src, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(d2h_stream):
            dst.copy_(gpu_out, non_blocking=True)

    def h2d_and_d2h() -> None:
        h2d()
        d2h()

    return CopyRates(timed_rates(h2d, nbytes, repeats), timed_rates(d2h, nbytes, repeats),
                     timed_rates(h2d_and_d2h, 2 * nbytes, repeats) if both else [])


@dataclass
class ArenaCopyRates:
    registered: bool  # Arena.register_cuda succeeded (else `pinned` was measured on pageable pages)
    pageable: CopyRates  # the segments as mapped, before cudaHostRegister
    pinned: CopyRates  # after it


def arena_copy_rates(numel: int, repeats: int) -> ArenaCopyRates:
    """Copies between the GPU and a fresh arena's params and grads segments (`numel` fp32 each), before and
    after Arena.register_cuda: the path weights and gradients take. The arena is removed afterwards."""
    arena = Arena.create(numel)
    try:
        arena.params.normal_()
        pageable = copy_rates(arena.params, arena.grads, repeats, both=False)
        registered = arena.register_cuda(("params", "grads"))
        return ArenaCopyRates(registered, pageable, copy_rates(arena.params, arena.grads, repeats))
    finally:
        arena.destroy()


# ---- the optimizer kernel ----

HEAD_DIM = 64
VOCAB = 1024  # small: the arena is mostly decoder layers, as in a real model


def config_for_params(target: float) -> ModelConfig:
    """A Llama shape of about `target` parameters: ~24 layers of width sqrt(target / (12 * 24))."""
    hidden = max(HEAD_DIM, int(math.sqrt(target / (12 * 24))) // HEAD_DIM * HEAD_DIM)  # layer ~ 12 h^2 params
    one = ModelConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=1, num_heads=hidden // HEAD_DIM)
    layers = max(1, round((target - (one.num_params() - one.layer_params())) / one.layer_params()))
    return ModelConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=hidden // HEAD_DIM)


def fill(params: torch.Tensor, grads: torch.Tensor, seed: int = 0) -> None:
    """Weights and gradients of a plausible scale (the kernel's speed does not depend on their values)."""
    torch.manual_seed(seed)
    params.normal_(0.0, 0.02)
    grads.normal_(0.0, 1e-3)


def fused_adamw_seconds(layout: ModelLayout, optim: OptimConfig, repeats: int, threads: int) -> list[float]:
    """Seconds of each of `repeats` torch.optim.AdamW(fused=True) steps over the layout's tensors in this
    process with `threads` threads (torch's fused CPU kernel, the one the optimizer workers run), after one
    untimed step that allocates and first-touches the moments."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat_p, flat_g = torch.empty(layout.numel), torch.empty(layout.numel)
        fill(flat_p, flat_g)
        decay, no_decay = [], []
        for unit in layout.units:
            grads = unit.bind(unit.range_of(flat_g))
            for slot in unit.slots:
                p = torch.nn.Parameter(unit.bind(unit.range_of(flat_p))[slot.name])
                p.grad = grads[slot.name]
                (decay if slot.decay else no_decay).append(p)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=True)
        opt.step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        return times
    finally:
        torch.set_num_threads(before)
