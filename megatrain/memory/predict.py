"""Predicted step time: a calibration of this machine, the memory plan's bytes and FLOPs, and the schedule's overlap.

    cal = Calibration.load("cpu") or calibrate("cpu", config, batch=2, seq=256)   # measured once, cached as JSON
    plan = plan_run(config, 2, 256, ...)
    pred = predict(plan, config, cal, optimizer_workers=2, clipping=True)
    pred.step_s, pred.tokens_per_s, pred.bound

What each lane costs per step:
  compute    the executor's forward, head and recompute+backward of every micro-batch. Where the calibration timed
             this model's layers at this micro-batch shape (an in-process Executor on 1 and 2 layers of the model:
             the difference is one layer's forward + recompute + backward + its gradients' norm and copy out;
             the rest is the embedding, the head and the step's fixed cost) from those times; else from matmul
             FLOPs (forward 2 per weight per token and attention's scores; x4 for forward + recompute + backward,
             x3 for the head, which is not recomputed) at the calibrated matmul rate, which ignores the
             elementwise work and is optimistic (compute_source says which).
  h2d, d2h   plan.h2d_bytes / d2h_bytes at the calibrated copy rates (a GPU's registered arena). On the CPU path
             the weights are read in place (no H2D); gradients are still copied into the arena, by the compute
             thread, and that copy is inside the timed layers.
  optimizer  every parameter's fused AdamW update at the calibrated rate of that many workers.
  data       tokens x the calibrated per-token data time (0 where not measured: the loader prefetches).
  network    several nodes: plan.network_bytes (each node's gradients summed with the others', its updated part
             of the weights sent to them) at `link_gbps` (given: one machine cannot measure the link between two;
             default LINK_GBPS). The gradients' exchange runs inside the backward, unit by unit, and the weights'
             beside the next forward: counted whole, an upper bound. Each node's optimizer updates 1/nodes of
             the parameters; each executor computes its own rows (the plan's batch), so a step trains
             executors x nodes times the plan's tokens.
How they overlap (megatrain/engine/executor.py, pipelines/engine.py):
  GPU: weights stream in while the layer before computes (two buffers) and gradients stream out during the
  backward: the copy lanes run beside compute, only the first layer's load exposed. The optimizer runs on the
  CPU beside the GPU: clipping off (grads = "stream") each layer is updated as its gradients land, beside the
  rest of the backward and the next forward; clipping on ("arena", "device") the update starts once the step's
  norm is known and overlaps the next step's forward only (the forward waits for each layer's update), so what
  of it outlasts that forward adds to the step.
  CPU: compute, the optimizer workers and the data loader share the same cores; the lanes add up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatrain.config import GRAD_PLACEMENTS, LINK_GBPS, ModelConfig, OptimConfig
from megatrain.memory.plan import AUTO, MIN_TILE_TOKENS, TILE_TOKENS, MemoryPlan, plan_run

CACHE_ENV = "MEGATRAIN_CALIBRATION"  # a file path: where the calibration is read and written (tests, benchmarks)
STEP_OVERHEAD_S = 0.005  # the driver's per-step Ray calls and version checks (a tiny model's steps take ~5 ms)
MAX_CALIBRATED_WORKERS = 16


@dataclass
class LayerTiming:
    """One model shape's compute at one micro-batch, timed by an in-process Executor on this device."""

    layer_s: float  # one decoder layer: forward + recompute + backward, its gradients' norm and copy out
    rest_s: float  # the embedding, the head (forward and backward) and a pass's fixed cost


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
    data_s_per_token: float = 0.0

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
        path = path or cls.path(device)
        try:
            raw = json.loads(path.read_text())
            raw["layers"] = {k: LayerTiming(**v) for k, v in raw.get("layers", {}).items()}
            cal = cls(**raw)
        except (OSError, ValueError, TypeError):
            return None
        return cal if cal.device == device else None

    def adamw_rate(self, workers: int) -> float:
        """G params/s of `workers` optimizer workers: the measured count, else the nearest one below (more
        workers than measured gain nothing more)."""
        counts = sorted(int(k) for k in self.adamw_gparams)
        below = [c for c in counts if c <= workers] or counts[:1]
        return self.adamw_gparams[str(below[-1])] if below else math.nan


def device_name(device: str) -> str:
    """The calibration's device: "cpu", or the CUDA device's name."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def layer_key(config: ModelConfig, batch: int, seq: int, precision: str) -> str:
    """Names a model's layer shape (whatever its depth) at one micro-batch and precision."""
    shape = {k: v for k, v in config.to_dict().items() if k != "num_layers"}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{config.model_type}-{config.hidden_size}-{digest}|{batch}x{seq}|{precision}"


# ---- FLOPs ----

def forward_matmul_flops(config: ModelConfig, batch: int, seq: int) -> tuple[float, float]:
    """(one decoder layer's, the head's) forward FLOPs for batch x seq tokens: 2 per weight per token, plus
    attention's scores and weighted sum (4 * seq * q per token, the causal half not subtracted, as SDPA computes)."""
    tokens = batch * seq
    q = config.num_heads * config.head_dim
    layer = 2 * tokens * config.layer_params() + 4 * tokens * seq * q
    head = 2 * tokens * config.hidden_size * config.vocab_size
    return layer, head


# ---- the prediction ----

@dataclass
class Prediction:
    compute_s: float
    h2d_s: float
    d2h_s: float
    optimizer_s: float
    data_s: float
    overhead_s: float
    step_s: float
    tokens_per_s: float
    bound: str  # the lane with the largest time: compute | h2d | d2h | optimizer | data | network
    compute_source: str  # "measured layers" or "matmul rate" (see the module's docstring)
    exposed: dict[str, float] = field(default_factory=dict)  # what each lane adds beyond compute
    network_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_step_s": self.step_s, "predicted_tokens_per_s": self.tokens_per_s, **asdict(self)}

    def report(self) -> str:
        ms = lambda s: f"{1e3 * s:,.1f} ms"  # noqa: E731
        names = ("compute", "h2d", "d2h", "optimizer", "data") + (("network",) if self.network_s else ())
        lanes = ", ".join(f"{name} {ms(getattr(self, name + '_s'))}" for name in names)
        return (f"predicted step: {ms(self.step_s)}, {self.tokens_per_s:,.0f} tokens/s, bound by {self.bound}\n"
                f"  per step: {lanes} (compute from {self.compute_source})")


def compute_seconds(plan: MemoryPlan, config: ModelConfig, cal: Calibration, precision: str) -> tuple[float, str]:
    """The executor's compute per step, and where it came from."""
    k = plan.micro_batches
    timing = cal.layers.get(layer_key(config, plan.batch, plan.seq, precision))
    if timing is not None:
        return k * (config.num_layers * timing.layer_s + timing.rest_s), "measured layers"
    rate = cal.matmul_tflops.get(precision) or cal.matmul_tflops.get("fp32") or math.nan
    layer, head = forward_matmul_flops(config, plan.batch, plan.seq)
    return k * (4 * config.num_layers * layer + 3 * head) / (rate * 1e12), "matmul rate"


def predict(plan: MemoryPlan, config: ModelConfig, cal: Calibration, *, precision: str = "tf32",
            optimizer_workers: int = 2, clipping: bool = True, executors: int = 1, link_gbps: float = LINK_GBPS
            ) -> Prediction:
    """The step time of the run `plan` describes on the calibrated machine, with `executors` executors on each of
    plan.nodes nodes (see the module docstring)."""
    compute, source = compute_seconds(plan, config, cal, precision)
    on_gpu = plan.on_gpu and cal.h2d_gbps is not None
    h2d = plan.h2d_bytes / (cal.h2d_gbps * 1e9) if on_gpu else 0.0
    d2h = plan.d2h_bytes / (cal.d2h_gbps * 1e9) if on_gpu and cal.d2h_gbps else 0.0
    tokens = plan.step_tokens * executors * plan.nodes  # a step's, over every executor of the run
    optimizer = plan.params / plan.nodes / (cal.adamw_rate(optimizer_workers) * 1e9)
    data = tokens * cal.data_s_per_token  # one loader feeds every executor of the run
    network = plan.network_bytes / (link_gbps * 1e9)
    overhead = STEP_OVERHEAD_S
    lanes = {"compute": compute, "h2d": h2d, "d2h": d2h, "optimizer": optimizer, "data": data, "network": network}
    if not on_gpu:  # one set of cores for all of them
        exposed = {"optimizer": optimizer, "data": data, "network": network}
        step = compute + optimizer + data + network + overhead
    else:
        layers = max(config.num_layers, 1)
        first_load = h2d / (2 * layers * (plan.micro_batches if plan.schedule == "per-micro-batch" else 1))
        if clipping or plan.grads == "device":
            # the update overlaps the next step's forward only: a quarter of the layers' compute (forward of
            # forward + recompute + backward), the head and embedding not counted
            forward = compute / 4
            opt_exposed = max(0.0, optimizer + (d2h if plan.grads == "device" else 0.0) - forward)
        else:  # streamed: each layer's update runs beside the rest of the step
            opt_exposed = max(0.0, optimizer - compute)
        busy = max(compute + opt_exposed, h2d, d2h, data)
        exposed = {"h2d": first_load + max(0.0, h2d - compute), "d2h": max(0.0, d2h - compute),
                   "optimizer": opt_exposed, "data": max(0.0, data - compute), "network": network}
        step = busy + first_load + network + overhead
    bound = max(lanes, key=lambda name: lanes[name])
    return Prediction(compute, h2d, d2h, optimizer, data, overhead, step, tokens / step, bound, source, exposed,
                      network)


# ---- picking what was left to "auto" ----

def auto_optimizer_workers(free_cpus: float, reserved_cpus: int = 0, cal: Calibration | None = None) -> int:
    """optimizer_workers = "auto" at a run's start: one worker per CPU Ray has free on the node, less
    `reserved_cpus` (a GPU executor's host threads, which Ray does not count), at most MAX_CALIBRATED_WORKERS; where
    this machine's calibration is given, the fewest of those with its highest measured AdamW rate (workers past
    the memory bandwidth only share it)."""
    most = max(1, min(MAX_CALIBRATED_WORKERS, int(free_cpus) - reserved_cpus))
    if cal is None or not cal.adamw_gparams:
        return most
    rates = {w: cal.adamw_rate(w) for w in range(1, most + 1)}
    best = max(rates.values())
    return min(w for w, rate in rates.items() if rate >= best)


@dataclass
class Choice:
    plan: MemoryPlan
    prediction: Prediction
    optimizer_workers: int
    tried: int  # candidates that fit memory and were predicted


def choose(config: ModelConfig, batch: int, seq: int, cal: Calibration, *, optimizer_workers: int | str = AUTO,
           grads: str = AUTO, tile_tokens: int | None | str = AUTO, clipping: bool = True, precision: str = "tf32",
           max_workers: int | None = None, **plan_kwargs: Any) -> Choice | None:
    """The fastest predicted run among the settings left "auto" that fits memory (None: none fits).
    optimizer_workers: 1 .. max_workers (default: the cores); grads: the placements clipping allows (the GPU's
    only on a GPU); tile_tokens: untiled and TILE_TOKENS halved down to MIN_TILE_TOKENS, below the micro-batch's
    tokens. Micro-batches and the schedule are taken as given (plan_run picks the schedule where it is auto)."""
    on_gpu = plan_kwargs.get("on_gpu", False)
    cores = os.cpu_count() or 1
    workers = (range(1, (max_workers or min(cores, MAX_CALIBRATED_WORKERS)) + 1) if optimizer_workers == AUTO
               else [int(optimizer_workers)])
    placements = ([g for g in GRAD_PLACEMENTS if g != AUTO and not (g == "stream" and clipping)
                   and not (g == "device" and not on_gpu)] if grads == AUTO else [grads])
    tokens = batch * seq
    tiles: list[int | None | str] = ([None] + [TILE_TOKENS >> i for i in range((TILE_TOKENS // MIN_TILE_TOKENS)
                                                                              .bit_length())
                                               if TILE_TOKENS >> i < tokens]
                                     if tile_tokens == AUTO and config.family.tiles else [tile_tokens])
    best: Choice | None = None
    tried = 0
    for w in workers:
        for g in placements:
            for tile in tiles:
                plan = plan_run(config, batch, seq, grads=g, clipping=clipping, precision=precision,
                                optimizer_workers=w, tile_tokens=tile, find_longest=False, **plan_kwargs)
                if plan.host_problem() or plan.gpu_problem():
                    continue
                tried += 1
                pred = predict(plan, config, cal, precision=precision, optimizer_workers=w, clipping=clipping,
                               executors=plan_kwargs.get("executors", 1))
                # ties (the CPU path's lanes do not depend on the placement) go to the earlier, leaner candidate
                if best is None or pred.step_s < best.prediction.step_s * (1 - 1e-9):
                    best = Choice(plan, pred, w, 0)
    if best is not None:
        best.tried = tried
    return best


# ---- measuring ----

def calibrate(device: str = "cpu", config: ModelConfig | None = None, *, batch: int = 1, seq: int = 512,
              precision: str = "tf32", max_seconds: float = 60.0, base: Calibration | None = None) -> Calibration:
    """Measures this machine: copy rates (a registered arena on a GPU, a host memcpy on the CPU), the matmul rate
    per precision, fused AdamW for 1..cores workers, and with `config` that model's layers at batch x seq tokens.
    Sizes are scaled to finish in about max_seconds (a few seconds for tests). `base`: an earlier calibration
    of the device whose layer timings are kept (the cache grows one entry per model shape)."""
    import torch

    from megatrain.calibrate import (
        arena_copy_rates,
        config_for_params,
        fused_adamw_seconds,
        matmul_tflops,
        memcpy_gbps,
        time_layers,
    )
    from megatrain.model.layout import ModelLayout

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
        adamw: dict[str, float] = {}
        layout = ModelLayout.build(config_for_params(max(2e6, 3e7 * scale)))
        for w in range(1, min(cores, MAX_CALIBRATED_WORKERS) + 1):
            # w workers x (cores // w) threads each, approximated by one process with as many threads in all
            # (the workers' processes share the memory bandwidth the same way)
            seconds = fused_adamw_seconds(layout, OptimConfig(), repeats=2, threads=w * max(1, cores // w))
            adamw[str(w)] = layout.numel / min(seconds) / 1e9
        cal = Calibration(device=device_name(device), host=socket.gethostname(), created=time.time(), cores=cores,
                          compute_threads=threads, h2d_gbps=h2d, d2h_gbps=d2h, memcpy_gbps=memcpy,
                          matmul_tflops=matmul, adamw_gparams=adamw,
                          layers=dict(base.layers) if base is not None else {})
        if config is not None:
            left = max_seconds - (time.monotonic() - start)
            layer, head = forward_matmul_flops(config, batch, seq)
            # a first run of the 2-layer model from the matmul rate: skipped where it alone would not fit (a 7B
            # model's layers on a CPU); time_layers stops after that first run where the rest would not
            guess = (8 * layer + 3 * head) / ((matmul.get(precision) or matmul["fp32"]) * 1e12)
            left = max(left, 1.0)
            timing = None if guess > left else time_layers(config, batch, seq, device, precision, budget_s=left)
            if timing is not None:
                cal.layers[layer_key(config, batch, seq, precision)] = LayerTiming(*timing)
        return cal
    finally:
        torch.set_num_threads(before)


__all__ = ["Calibration", "Choice", "LayerTiming", "Prediction", "calibrate", "choose", "layer_key", "predict"]
