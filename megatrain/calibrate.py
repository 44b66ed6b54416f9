"""Measurements of this machine: host <-> GPU copy rates from the arena, and the fused AdamW kernel's speed.

`megatrain doctor` runs them small; benchmarks/pcie.py and benchmarks/optimizer.py run them at full size and
print tables. `megatrain calibrate` (megatrain/memory/predict.py: calibrate) runs them beside the matmul rate,
a host memcpy and a model's layers timed in an Executor, to predict step times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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


# ---- compute ----

def memcpy_gbps(nbytes: int) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9  # read and written


def matmul_tflops(device: str, precision: str, config: ModelConfig | None, tokens: int, scale: float) -> float:
    """TFLOP/s of [m, k] @ [k, n] in `precision`: the model's MLP up-projection shape (tokens x hidden x ffn)
    where given, else a square one sized for the device."""
    from megatrain.engine.executor import set_matmul_precision

    if config is not None:
        m, k, n = tokens, config.hidden_size, config.intermediate_size
    else:
        m = k = n = 4096 if device.startswith("cuda") else max(256, int(1024 * scale ** 0.5))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    if device.startswith("cuda"):
        set_matmul_precision(precision)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    best, total, t_end = math.inf, 0, time.monotonic() + max(0.2, 2 * scale)
    while total < 3 or (time.monotonic() < t_end and total < 50):
        t0 = time.perf_counter()
        a @ b
        sync()
        best, total = min(best, time.perf_counter() - t0), total + 1
    return 2 * m * k * n / best / 1e12


def time_layers(config: ModelConfig, batch: int, seq: int, device: str = "cpu", precision: str = "tf32",
                budget_s: float = 30.0, repeats: int = 3) -> tuple[float, float] | None:
    """(one layer's, the rest's) compute seconds for batch x seq tokens, timed in an in-process Executor (the code
    a run executes) on this model's shape. None where a first untimed step already takes more than a fifth of
    `budget_s`.

    Where copies run on streams of their own (a GPU, or the CPU's simulation of one), the compute stream's spans
    are the measurement: the copies are predicted apart, from the arena's PCIe rates, and here the weights are not
    in the registered arena (a 7B layer's round trip through pageable memory took 10x its compute on the H100).
    On the plain CPU path the cores that compute also copy: the wall clock of a 1- and a 2-layer model."""
    one = _timed_steps(config, 1, batch, seq, device, precision, budget_s, repeats)
    if one is None:
        return None
    asynchronous, steps = one
    if asynchronous:
        return min(s.layers_s for s in steps), min(s.rest_s for s in steps)
    two = _timed_steps(config, 2, batch, seq, device, precision, budget_s, repeats)
    if two is None:
        return None
    one_s, two_s = min(s.wall_s for s in steps), min(s.wall_s for s in two[1])
    layer = max(two_s - one_s, 0.0)
    return layer, max(one_s - layer, 0.0)


@dataclass
class _TimedStep:
    wall_s: float  # the host's clock around the step
    layers_s: float  # the decoder layers' compute spans, added up
    rest_s: float  # the other units' compute spans (embedding, head)


def _timed_steps(config: ModelConfig, layers: int, batch: int, seq: int, device: str, precision: str,
                 budget_s: float, repeats: int) -> tuple[bool, list[_TimedStep]] | None:
    """(whether the executor's streams are asynchronous, `repeats` timed steps after an untimed one) of this
    model's shape with `layers` decoder layers; None where the untimed one takes more than a fifth of `budget_s`."""
    from megatrain.engine.executor import Executor
    from megatrain.telemetry import Recorder

    shape = replace(config, num_layers=layers)
    layout = ModelLayout.build(shape)
    pinned = device.startswith("cuda")  # the host never waits on a pageable copy between two kernels' launches
    params, grads = torch.empty(layout.numel, pin_memory=pinned), torch.zeros(layout.numel, pin_memory=pinned)
    fill(params, grads)
    rec = Recorder()
    executor = Executor(shape, layout, params, grads, device, precision, recorder=rec)
    layer_units = {unit.index for unit in layout.layers}
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    steps = []
    try:
        for step in range(repeats + 1):  # the first: first touch, allocator warm-up, kernels' first launches
            t0 = time.perf_counter()
            rec.begin_step(step, executor.device)
            executor.run(ids)
            rec.end_step()
            wall = time.perf_counter() - t0
            if step == 0:
                if wall > budget_s / 5:
                    return None
                continue
            compute = [s for s in rec.spans if s.step == step and s.lane == "compute"]
            steps.append(_TimedStep(wall, sum(s.duration for s in compute if s.layer in layer_units),
                                    sum(s.duration for s in compute if s.layer not in layer_units)))
    finally:
        executor.close()
    return executor.streams.asynchronous, steps
