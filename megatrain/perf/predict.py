"""Predicted step time: a calibration of this machine, the memory plan's bytes and FLOPs, and the schedule's overlap.

    cal = Calibration.load("cpu") or calibrate("cpu", config, batch=2, seq=256)   # megatrain/perf/calibrate.py
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
  optimizer  every streamed parameter's fused AdamW update at the calibrated rate of that many workers: units resident
             on the device (plan.resident_params) are updated there in milliseconds, and their weights, gradients
             and embedding rows are already out of plan.h2d_bytes / d2h_bytes.
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

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from megatrain.config import GRAD_PLACEMENTS, LINK_GBPS, ModelConfig
from megatrain.memory.plan import AUTO, MIN_TILE_TOKENS, TILE_TOKENS, MemoryPlan, plan_run
from megatrain.perf.calibrate import MAX_CALIBRATED_WORKERS, Calibration, forward_matmul_flops, layer_key

STEP_OVERHEAD_S = 0.005  # the driver's per-step Ray calls and version checks (a tiny model's steps take ~5 ms)


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
    streamed = max(0, plan.params - plan.resident_params)  # resident units: updated on the device
    optimizer = streamed / plan.nodes / (cal.adamw_rate(optimizer_workers) * 1e9)
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


__all__ = ["Choice", "Prediction", "choose", "predict"]
