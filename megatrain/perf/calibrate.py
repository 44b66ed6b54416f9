"""Measuring this machine: `calibrate` (the one entry point, which `megatrain calibrate` and `megatrain plan` call)
times the copy rates, the matmul rate, the optimizer pool (alone and beside copies: megatrain/perf/optimizer_timing.py)
and a model's layers, into a Calibration cached as JSON, from which megatrain/perf/predict.py predicts step times.

    cal = Calibration.load(device_name("cpu")) or calibrate("cpu", config, batch=2, seq=256)
    cal.save()

`megatrain doctor` runs the copy and AdamW timings small; benchmarks/pcie.py and benchmarks/optimizer.py run them at
full size and print tables.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from megatrain.config import ConfigError, ModelConfig, OptimConfig
from megatrain.memory.arena import Arena
from megatrain.model.layout import ModelLayout
from megatrain.perf.optimizer_timing import time_optimizer

CACHE_ENV = "MEGATRAIN_CALIBRATION"  # a file path: where the calibration is read and written (tests, benchmarks)
MAX_CALIBRATED_WORKERS = 16

# ---- the calibration: what was measured ----


@dataclass
class LayerTiming:
    """One model shape's compute at one micro-batch, timed by an in-process Executor on this device."""

    layer_s: float  # one decoder layer: forward + recompute + backward, its gradients' norm and copy out
    rest_s: float  # the embedding, the head (forward and backward) and a pass's fixed cost


@dataclass
class CompiledTiming:
    """One model shape's compute at one micro-batch timed eager and through torch.compile (EngineConfig.compile), on
    a GPU: what compile "auto" decides from (megatrain/perf/compile_choice.py)."""

    eager_layer_s: float  # one decoder layer, as LayerTiming.layer_s
    compiled_layer_s: float
    eager_rest_s: float  # the embedding and the head, as LayerTiming.rest_s (the head is compiled too)
    compiled_rest_s: float
    compile_s: float  # the first compiled step's wall time less a compiled step's: compiling, once per run


@dataclass
class Calibration:
    device: str  # "cpu", or the GPU's name
    host: str
    created: float  # time.time() of the measurement
    cores: int
    compute_threads: int  # torch threads the executor computes with (the CPU path: every core)
    h2d_gbps: float | None  # registered arena -> device, 10^9 B/s; None: no copies (the CPU path)
    d2h_gbps: float | None
    memcpy_gbps: float  # host memory to host memory (the CPU path's gradient copies into the arena)
    matmul_tflops: dict[str, float] = field(default_factory=dict)  # precision -> TFLOP/s
    adamw_gparams: dict[str, float] = field(default_factory=dict)  # optimizer workers (as text) -> G params/s
    layers: dict[str, LayerTiming] = field(default_factory=dict)  # layer_key(...) -> timing
    compiled: dict[str, CompiledTiming] = field(default_factory=dict)  # layer_key(...) -> eager vs compiled (GPUs)
    data_s_per_token: float = 0.0
    # the pool while copies ran beside it (what a run sees: they share host memory bandwidth), its rollback pass
    # (roll back + clipped redo) beside them, the copies' host memory traffic then and what they were, the resident
    # units' fused AdamW on the GPU (megatrain/perf/optimizer_timing.py; adamw_gparams: the same pool alone)
    adamw_beside_copies_gparams: dict[str, float] = field(default_factory=dict)
    rollback_gparams: dict[str, float] = field(default_factory=dict)
    copies_gbps: float | None = None
    copies_kind: str = ""
    device_adamw_gparams: float | None = None
    # a step's fixed costs beyond compute, copies and the update, measured through Ray (pipelines/step_costs.py):
    # the driver's round trips a step, and one Ray message of a unit handed to an optimizer worker
    step_fixed_s: float | None = None
    unit_message_s: float | None = None
    source: str = "measured by megatrain calibrate"  # a calibration recorded by hand says where its numbers came from

    # ---- cache ----
    @staticmethod
    def path(device: str) -> Path:
        if os.environ.get(CACHE_ENV):
            return Path(os.environ[CACHE_ENV])
        slug = "".join(c if c.isalnum() else "-" for c in device.lower())
        return Path.home() / ".cache" / "megatrain" / f"calibration-{socket.gethostname()}-{slug}.json"

    def save(self, path: Path | None = None) -> Path:
        path = path or self.path(self.device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)  # a reader never sees half a file
        return path

    @classmethod
    def load(cls, device: str, path: Path | None = None) -> Calibration | None:
        """The cached calibration of `device` on this host, or None (none yet, or unreadable)."""
        try:
            cal = cls.read(path or cls.path(device))
        except ConfigError:
            return None
        return cal if cal.device == device else None

    @classmethod
    def read(cls, path: Path) -> Calibration:
        """The calibration in a file, whatever its device (`megatrain plan --calibration`), or one sentence."""
        try:
            raw = json.loads(path.read_text())
            raw["layers"] = {k: LayerTiming(**v) for k, v in raw.get("layers", {}).items()}
            raw["compiled"] = {k: CompiledTiming(**v) for k, v in raw.get("compiled", {}).items()}
            return cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{path} is not a readable calibration ({e}); `megatrain calibrate` writes one."
                              ) from None

    def adamw_rate(self, workers: int, beside: bool = True) -> float:
        """G params/s of `workers` optimizer workers, beside the copies where that was measured (else alone): the
        measured count, else the nearest one below (more workers than measured gain nothing more)."""
        beside = beside and bool(self.adamw_beside_copies_gparams)
        return rate_at(self.adamw_beside_copies_gparams if beside else self.adamw_gparams, workers)

    def rollback_rate(self, workers: int) -> float | None:
        return rate_at(self.rollback_gparams, workers) if self.rollback_gparams else None


def rate_at(rates: dict[str, float], workers: int) -> float:
    """The rate of the measured count of workers, else of the nearest one below (or the fewest measured)."""
    counts = sorted(int(k) for k in rates)
    below = [c for c in counts if c <= workers] or counts[:1]
    return rates[str(below[-1])] if below else math.nan


def device_name(device: str) -> str:
    """The calibration's device: "cpu", or the CUDA device's name."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def layer_key(config: ModelConfig, batch: int, seq: int, precision: str) -> str:
    """Names a model's layer shape (whatever its depth) at one micro-batch and precision."""
    shape = {k: v for k, v in config.to_dict().items() if k != "num_layers"}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{config.model_type}-{config.hidden_size}-{digest}|{batch}x{seq}|{precision}"


# ---- measuring: the entry point ----

def calibrate(device: str = "cpu", config: ModelConfig | None = None, *, batch: int = 1, seq: int = 512,
              precision: str = "tf32", max_seconds: float = 60.0, base: Calibration | None = None,
              time_compile: bool = True) -> Calibration:
    """Measures this machine: copy rates (a registered arena on a GPU, a host memcpy on the CPU), the matmul rate
    per precision, the optimizer pool of 1..cores workers alone and beside copies, and with `config` that model's
    layers at batch x seq tokens. Sizes are scaled to finish in about max_seconds (a few seconds for tests). `base`: an
    earlier calibration of the device whose layer timings are kept (the cache grows one entry per model shape).
    time_compile: on a GPU, with `config`, the layer and the head also through torch.compile (time_compiled: a minute
    or more of compiling, beyond max_seconds)."""
    start = time.monotonic()
    on_gpu = device.startswith("cuda")
    cores = os.cpu_count() or 1
    threads = cores if not on_gpu else torch.get_num_threads()
    scale = min(1.0, max_seconds / 60.0)  # the full-size run takes about a minute on the 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if on_gpu:
            rates = arena_copy_rates(int(64 * 2**20 * max(scale, 0.1)) // 4, repeats=3)
            pinned = rates.pinned
            h2d, d2h = sorted(pinned.h2d)[len(pinned.h2d) // 2], sorted(pinned.d2h)[len(pinned.d2h) // 2]
        else:
            h2d = d2h = None
        memcpy = memcpy_gbps(int(64 * 2**20 * max(scale, 0.05)))
        matmul = {p: matmul_tflops(device, p, config, batch * seq, scale)
                  for p in (("fp32", "tf32", "bf16") if on_gpu else ("fp32",))}
        if not on_gpu:  # the CPU computes fp32 whatever the precision asked (tf32 is the GPU's)
            matmul["tf32"] = matmul["fp32"]
        cal = Calibration(device=device_name(device), host=socket.gethostname(), created=time.time(), cores=cores,
                          compute_threads=threads, h2d_gbps=h2d, d2h_gbps=d2h, memcpy_gbps=memcpy,
                          matmul_tflops=matmul,
                          layers=dict(base.layers) if base is not None else {},
                          compiled=dict(base.compiled) if base is not None else {},
                          step_fixed_s=base.step_fixed_s if base is not None else None,  # measured by the driver
                          unit_message_s=base.unit_message_s if base is not None else None)
        if config is not None:
            left = max_seconds - (time.monotonic() - start)
            layer, head = forward_matmul_flops(config, batch, seq)
            # a first run of the 2-layer model from the matmul rate: skipped where it alone would not fit (a 7B
            # model's layers on a CPU); time_layers stops after that first run where the rest would not
            guess = (8 * layer + 3 * head) / ((matmul.get(precision) or matmul["fp32"]) * 1e12)
            left = max(left, 5.0)  # its first step's guard (a fifth of this) must not trip on a loaded machine
            timing = None if guess > left else time_layers(config, batch, seq, device, precision, budget_s=left)
            if timing is not None:
                cal.layers[layer_key(config, batch, seq, precision)] = LayerTiming(*timing)
            compiled = None if timing is None or not (on_gpu and time_compile) else time_compiled(
                config, batch, seq, device, precision, LayerTiming(*timing), max(COMPILE_BUDGET_S, left))
            if compiled is not None:
                cal.compiled[layer_key(config, batch, seq, precision)] = compiled
        # the pool of 1 .. cores workers in processes of their own, alone and beside copies (optimizer_timing.py),
        # last: the layers' budget is what max_seconds leaves after the short measurements
        return replace(cal, **time_optimizer(device, config_for_params(max(1e6, 2e8 * scale)), cores, precision,
                                             min(cores, MAX_CALIBRATED_WORKERS)))
    finally:
        torch.set_num_threads(before)


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


def forward_matmul_flops(config: ModelConfig, batch: int, seq: int) -> tuple[float, float]:
    """(one decoder layer's, the head's) forward FLOPs for batch x seq tokens: 2 per weight per token, plus
    attention's scores and weighted sum (4 * seq * q per token, the causal half not subtracted, as SDPA computes)."""
    tokens = batch * seq
    q = config.num_heads * config.head_dim
    layer = 2 * tokens * config.layer_params() + 4 * tokens * seq * q
    head = 2 * tokens * config.hidden_size * config.vocab_size
    return layer, head


def matmul_tflops(device: str, precision: str, config: ModelConfig | None, tokens: int, scale: float) -> float:
    """TFLOP/s of [m, k] @ [k, n] in `precision`: the model's MLP up-projection shape (tokens x hidden x ffn)
    where given, else a square one sized for the device."""
    from megatrain.engine.torch_settings import set_matmul_precision

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
    asynchronous, steps, _ = one
    if asynchronous:
        return min(s.layers_s for s in steps), min(s.rest_s for s in steps)
    two = _timed_steps(config, 2, batch, seq, device, precision, budget_s, repeats)
    if two is None:
        return None
    one_s, two_s = min(s.wall_s for s in steps), min(s.wall_s for s in two[1])
    layer = max(two_s - one_s, 0.0)
    return layer, max(one_s - layer, 0.0)


COMPILE_BUDGET_S = 300.0  # seconds a calibration may spend compiling the model's layer and head (minutes at 7B)


def time_compiled(config: ModelConfig, batch: int, seq: int, device: str, precision: str, eager: LayerTiming,
                  budget_s: float = COMPILE_BUDGET_S, repeats: int = 3) -> CompiledTiming | None:
    """The model's layer and the rest timed through torch.compile as time_layers times them eager (`eager`, its
    result), on a device whose copies run on streams of their own (a GPU; the CPU's simulated streams in tests).
    None where compiling takes longer than `budget_s`."""
    timed = _timed_steps(config, 1, batch, seq, device, precision, budget_s, repeats, compile=True)
    if timed is None or not timed[0]:
        return None
    _, steps, first_s = timed
    return CompiledTiming(eager.layer_s, min(s.layers_s for s in steps), eager.rest_s, min(s.rest_s for s in steps),
                          max(first_s - min(s.wall_s for s in steps), 0.0))


@dataclass
class _TimedStep:
    wall_s: float  # the host's clock around the step
    layers_s: float  # the decoder layers' compute spans, added up
    rest_s: float  # the other units' compute spans (embedding, head)


def _timed_steps(config: ModelConfig, layers: int, batch: int, seq: int, device: str, precision: str,
                 budget_s: float, repeats: int, compile: bool = False) -> tuple[bool, list[_TimedStep], float] | None:
    """(whether the executor's streams are asynchronous, `repeats` timed steps after an untimed one, the untimed
    one's wall seconds) of this model's shape with `layers` decoder layers; None where the untimed one takes more
    than a fifth of `budget_s` (compile: more than budget_s, its compiling included)."""
    with executor_steps(replace(config, num_layers=layers), batch, seq, device, precision, compile) as (step, streams):
        first = step()  # first touch, allocator warm-up, kernels' first launches
        if first.wall_s > (budget_s if compile else budget_s / 5):
            return None
        return streams.asynchronous, [step() for _ in range(repeats)], first.wall_s


@contextmanager
def executor_steps(config: ModelConfig, batch: int, seq: int, device: str = "cpu", precision: str = "tf32",
                   compile: bool = False) -> Iterator[tuple[Callable[[], _TimedStep], Any]]:
    """(a function that runs and times one step of an in-process Executor of this model on random tokens, its
    streams): the code a run executes, without Ray, the driver or the optimizer (pipelines/step_costs.py times
    those against it)."""
    from megatrain.engine.executor import Executor
    from megatrain.telemetry import Recorder

    layout = ModelLayout.build(config)
    pinned = device.startswith("cuda")  # the host never waits on a pageable copy between two kernels' launches
    params, grads = torch.empty(layout.numel, pin_memory=pinned), torch.zeros(layout.numel, pin_memory=pinned)
    fill(params, grads)
    rec = Recorder()
    executor = Executor(config, layout, params, grads, device, precision, recorder=rec, compile=compile)
    layer_units = {unit.index for unit in layout.layers}
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    count = itertools.count()

    def step() -> _TimedStep:
        n = next(count)
        t0 = time.perf_counter()
        rec.begin_step(n, executor.device)
        executor.run(ids)
        rec.end_step()
        wall = time.perf_counter() - t0
        compute = [s for s in rec.spans if s.step == n and s.lane == "compute"]
        return _TimedStep(wall, sum(s.duration for s in compute if s.layer in layer_units),
                          sum(s.duration for s in compute if s.layer not in layer_units))

    try:
        yield step, executor.streams
    finally:
        executor.close()
