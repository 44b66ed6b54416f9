"""Predicted step time: a calibration of this machine, the memory plan's bytes and FLOPs, and the engine's schedule.

    cal = Calibration.load("cpu") or calibrate("cpu", config, batch=2, seq=256)   # megatrain/perf/calibrate.py
    plan = plan_run(config, 2, 256, ...)
    pred = predict(plan, config, cal, optimizer_workers=2, clipping=True, speculate="auto", clip_rate=0.0)
    pred.step_s, pred.tokens_per_s, pred.bound, pred.phases, pred.cases

A step's parts (compute, copies, update, overlap, data, network, fixed), one function each, each following one engine
behaviour: docs/design.md#the-predicted-step."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from megatrain.config import GRAD_PLACEMENTS, LINK_GBPS, SPECULATE, ModelConfig, check_choice
from megatrain.memory.crossings import LAYER_IN, LAYER_OUT, crossing_bytes
from megatrain.memory.plan import AUTO, MIN_TILE_TOKENS, TILE_TOKENS, MemoryPlan, plan_run
from megatrain.perf.calibrate import MAX_CALIBRATED_WORKERS, Calibration, forward_matmul_flops, layer_key

# a layer's FLOPs: forward 1, recompute 1 (the forward again), backward 2 (two matmuls per forward one)
FORWARD_SHARE, RECOMPUTE_SHARE = 0.25, 0.25
# the rollback pass against the update's where calibration did not time it: half the update's rate, as measured on
# the 2-core development machine (benchmarks/RESULTS.md: 0.71 against 1.42 G params/s)
ROLLBACK_COST = 2.0
CASES = ("speculated", "rolled back", "serial")
DEVICE_ADAMW_BYTES = 28  # read and written a parameter by the fused AdamW (fp32 weight, gradient, m, v; three written)
CAST_BYTES = 6  # read and written a parameter by a cast of fp32 weights to bf16


# ---- the prediction ----

@dataclass
class Prediction:
    compute_s: float
    h2d_s: float
    d2h_s: float
    optimizer_s: float  # the CPU pool's update of the streamed units (the resident ones: resident_update_s)
    data_s: float
    overhead_s: float  # the step's fixed costs (fixed_costs), the mean case
    step_s: float  # mean over the cases, weighted by how often each runs
    tokens_per_s: float
    bound: str  # the part with the largest time: compute | h2d | d2h | optimizer | data | network
    compute_source: str  # where the compute came from (docs/design.md#the-predicted-step)
    exposed: dict[str, float] = field(default_factory=dict)  # what each part adds beyond compute (the mean case)
    network_s: float = 0.0
    resident_update_s: float = 0.0  # the resident units' update on the device
    rollback_s: float = 0.0  # the pool's rollback pass (a speculated step that clipped)
    optimizer_rate: str = ""  # which calibrated pool rate the update took, in G params/s
    speculate: str = "auto"
    clip_rate: float = 0.0  # the assumed share of steps that clip
    kept_layers: int = 0  # layers whose activations are kept (no recompute)
    cases: dict[str, dict[str, float]] = field(default_factory=dict)  # case -> {"share", "step_s", "exposed_update_s"}
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)  # forward/head/backward/update -> {"s", "bound"}
    fixed_source: str = ""  # where the fixed costs came from (fixed_costs)
    forward_s: float = 0.0  # the compute's phases (Compute): what the update's disk traffic can run beside
    backward_s: float = 0.0  # the head's and the layers' backward

    def beside_update_s(self) -> float:
        """The compute the optimizer's pass runs beside, the cases' mean: an update beside the backward during the
        backward, the serial walk during the next forward (which waits for each unit's update in turn)."""
        return sum(c["share"] * (self.forward_s if name == "serial" else self.backward_s)
                   for name, c in self.cases.items())

    @property
    def uncalibrated(self) -> str:
        """Why this prediction is not of a regime the calibration measured ("" where it is): the compute of layers it
        did not time (the matmul rate misses every elementwise op and launch), or fixed costs it did not measure."""
        why = [] if self.compute_source.startswith("measured layers") else [f"compute from the {self.compute_source}"]
        return "; ".join(why + ([] if self.fixed_source.startswith("measured") else [self.fixed_source]))

    def shown_step_s(self, case: str) -> float | None:
        """The predicted step of a step whose update ran as `case`, as a run's progress line shows it: None where
        the prediction is not of a calibrated regime (report() says why)."""
        return None if self.uncalibrated else self.cases[case]["step_s"]

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_step_s": self.step_s, "predicted_tokens_per_s": self.tokens_per_s, **asdict(self)}

    def report(self) -> str:
        ms = lambda s: f"{1e3 * s:,.1f} ms"  # noqa: E731
        names = ("compute", "h2d", "d2h", "optimizer", "data") + (("network",) if self.network_s else ())
        lanes = ", ".join(f"{name} {ms(getattr(self, name + '_s'))}" for name in names)
        phases = ", ".join(f"{name} {ms(p['s'])} ({p['bound']})" for name, p in self.phases.items())
        cases = ", ".join(f"{name} {ms(c['step_s'])} x {c['share']:.2f}" for name, c in self.cases.items()
                          if c["share"])
        return (f"predicted step: {ms(self.step_s)}, {self.tokens_per_s:,.0f} tokens/s, bound by {self.bound}\n"
                f"  per step: {lanes} (compute from {self.compute_source}; update at {self.optimizer_rate})\n"
                f"  phases: {phases}\n"
                f"  update beside the backward (speculate {self.speculate}, clip rate {self.clip_rate:g} assumed): "
                f"{cases}\n"
                f"  fixed costs: {ms(self.overhead_s)} ({self.fixed_source})"
                + (f"\n  not shown beside each step: {self.uncalibrated}; `megatrain calibrate --model M --batch B "
                   "--seq S --precision P` at this run's shape measures them" if self.uncalibrated else ""))


@dataclass
class LayerTimes:
    """One micro-batch's compute: a decoder layer's forward + recompute + backward, and the rest (embedding, head)."""

    layer_s: float
    rest_s: float
    source: str


def layer_times(plan: MemoryPlan, config: ModelConfig, cal: Calibration, precision: str, compiled: bool
                ) -> LayerTimes:
    """The executor's per-micro-batch compute (Executor.run): the calibration's timing of this layer shape at this
    micro-batch, compiled where the run compiles (CompiledTiming), else eager; else matmul FLOPs at the matmul rate."""
    key = layer_key(config, plan.batch, plan.seq, precision)
    timed = cal.compiled.get(key)
    if compiled and timed is not None:
        return LayerTimes(timed.compiled_layer_s, timed.compiled_rest_s, "measured layers, compiled")
    eager = cal.layers.get(key)
    if eager is not None:
        return LayerTimes(eager.layer_s, eager.rest_s,
                          "measured layers" + (", eager (compiled not timed)" if compiled else ""))
    rate = cal.matmul_tflops.get(precision) or cal.matmul_tflops.get("fp32") or math.nan
    layer, head = forward_matmul_flops(config, plan.batch, plan.seq)
    return LayerTimes(4 * layer / (rate * 1e12), 3 * head / (rate * 1e12), "matmul rate")


@dataclass
class Compute:
    forward_s: float  # every layer's forward over every micro-batch (layer-major)
    head_s: float  # the embedding and the head, forward and backward
    backward_s: float  # every layer's recompute (where not kept) and backward

    @property
    def total_s(self) -> float:
        return self.forward_s + self.head_s + self.backward_s


def compute_phases(plan: MemoryPlan, config: ModelConfig, times: LayerTimes, kept_layers: int, cast_s: float = 0.0
                   ) -> Compute:
    """The step's compute by phase (Executor._forward, _head, _backward): a kept layer's backward takes the forward's
    graph (KeptActivations.backward) and skips its recompute, for every micro-batch; cast_s: the resident weights'
    casts (resident_cast_s), half of them in each phase."""
    k, layers = plan.micro_batches, config.num_layers
    forward = k * layers * FORWARD_SHARE * times.layer_s
    backward = k * (layers * (1 - FORWARD_SHARE) - kept_layers * RECOMPUTE_SHARE) * times.layer_s
    return Compute(forward + cast_s / 2, k * times.rest_s, backward + cast_s / 2)


def resident_cast_s(plan: MemoryPlan, cal: Calibration) -> float:
    """Compute's casts of the resident units' fp32 weights to bf16 where they have no bf16 copy (resident_weights
    "cast": WeightSlots.fetch): each unit's twice a pass (its forward, its backward), CAST_BYTES a parameter, at the
    device's memory rate as its fused AdamW's rate gives it (DEVICE_ADAMW_BYTES a parameter)."""
    rate = cal.device_adamw_gparams if plan.on_gpu else cal.adamw_rate(1, beside=False)
    if plan.resident_weights != "cast" or not plan.resident_params or not rate:
        return 0.0
    passes = plan.micro_batches if plan.schedule == "per-micro-batch" else 1
    return 2 * passes * plan.resident_params * CAST_BYTES / (rate * 1e9 * DEVICE_ADAMW_BYTES)


def copy_times(plan: MemoryPlan, cal: Calibration) -> tuple[float, float]:
    """(H2D, D2H) seconds a step at the calibrated PCIe rates (0 on the CPU path: the weights are read in place, and
    the gradients' copy into the arena is part of the timed layers)."""
    if not plan.on_gpu or cal.h2d_gbps is None:
        return 0.0, 0.0
    return plan.h2d_bytes / (cal.h2d_gbps * 1e9), plan.d2h_bytes / (cal.d2h_gbps * 1e9) if cal.d2h_gbps else 0.0


@dataclass
class Update:
    pool_s: float  # the streamed units' update (this node's share) in the CPU pool
    rollback_s: float  # the pool's rollback pass over the same units
    resident_s: float  # the resident units' update on the device
    rate: str  # which pool rate, for the report


def update_times(plan: MemoryPlan, cal: Calibration, workers: int) -> Update:
    """The optimizer's work a step (AdamWShard.update in each worker; ResidentUnits.update on the device): the pool's
    rate beside the copies (Calibration.adamw_rate), the rollback's (AdamWShard.settle of a speculated unit), and the
    device's fused AdamW (the CPU path's "device" is the executor's cores: the one-worker pool's rate alone)."""
    streamed = max(0, plan.params - plan.resident_params) / plan.nodes
    rate = cal.adamw_rate(workers)
    which = "beside copies" if cal.adamw_beside_copies_gparams else "alone: the pool was not timed beside copies"
    pool = streamed / (rate * 1e9)
    rollback_rate = cal.rollback_rate(workers)
    rollback = streamed / (rollback_rate * 1e9) if rollback_rate else ROLLBACK_COST * pool
    device = cal.device_adamw_gparams if plan.on_gpu else cal.adamw_rate(1, beside=False)
    resident = plan.resident_params / (device * 1e9) if plan.resident_params and device else 0.0
    return Update(pool, rollback, resident, f"{rate:.2f} G params/s ({which})")


def fixed_costs(plan: MemoryPlan, config: ModelConfig, cal: Calibration, workers: int) -> tuple[dict[str, float], str]:
    """(each case's fixed costs, where they came from): the driver's round trips a step (Engine.step_once: the
    executor's run, the version table, the step's result) and one Ray message a streamed unit for each optimizer
    worker (Executor: hand_out of update_unit or speculate), again in a rollback (roll_back or update_unit), at the
    costs the calibration measured through Ray (pipelines/step_costs.py). 0 where it measured none."""
    if cal.step_fixed_s is None or cal.unit_message_s is None:
        return {c: 0.0 for c in CASES}, "not measured: `megatrain calibrate` measures them"
    messages = max(config.num_layers + 2 - plan.resident_units, 0) * workers
    once = cal.step_fixed_s + messages * cal.unit_message_s
    return ({c: once + (messages * cal.unit_message_s if c == "rolled back" else 0.0) for c in CASES},
            f"measured: {1e3 * cal.step_fixed_s:.1f} ms a step + {1e3 * cal.unit_message_s:.2f} ms x {messages} "
            "unit messages")


# ---- how much of the update the GPU waits for (pipelines/engine.py, Engine.step_once) ----

@dataclass
class Pipeline:
    """Per-unit times of the streamed pipeline on a GPU."""

    forward_s: float  # the forward phase, its weights' copies included
    layer_forward_s: float  # one layer's share of it (all the step's micro-batches)
    backward_s: float  # the backward phase, its copies included: the pace at which gradients land
    layer_backward_s: float
    load_s: float  # one layer's weights over PCIe (H2D)
    send_s: float  # one layer's gradient over PCIe (D2H)
    unit_update_s: float  # one streamed unit's update in the pool
    resident_layers: int
    streamed_layers: int
    embed_streamed: bool  # units are resident in forward order: the embedding first, the head last
    head_streamed: bool


def pipeline(plan: MemoryPlan, config: ModelConfig, forward: float, backward: float, h2d: float, d2h: float,
              update: Update) -> Pipeline:
    """The per-unit times: one layer's weights in and its gradient out as the plan's crossings say (their rows in
    megatrain/memory/crossings.py, timed at the rate the step's copies take: `h2d`, `d2h` seconds for all of them)."""
    layers = max(config.num_layers, 1)
    resident_layers = min(max(plan.resident_units - 1, 0), config.num_layers)
    streamed_layers = layers - resident_layers
    embed, head = plan.resident_units == 0, plan.resident_units < config.num_layers + 2
    units = max(streamed_layers + embed + head, 1)
    passes = plan.micro_batches if plan.schedule == "per-micro-batch" else 1
    per_layer = max(streamed_layers, 1) * passes
    load, send = (crossing_bytes(plan.buffers, name) for name in (LAYER_IN, LAYER_OUT))
    load_s = h2d * load / plan.h2d_bytes if load and plan.h2d_bytes else h2d / (2 * per_layer)
    send_s = d2h * send / plan.d2h_bytes if send and plan.d2h_bytes else d2h / per_layer
    return Pipeline(forward, forward / layers, backward, backward / layers, load_s, send_s,
                    update.pool_s / units, resident_layers, streamed_layers, embed, head)


def serial_exposed(p: Pipeline, pass_s: float, sends: bool, start_s: float) -> float:
    """The serial update (speculate off, or "auto" after a clipped step; also the rollback's redo): once the step's
    norm is known the pool walks the streamed units in forward order (OptimizerWorker.apply), beside the next forward,
    which waits for each layer's update, then its weights' H2D (Executor._forward: wait_weights, fetch). `pass_s`:
    the pool's pass over every streamed unit; `sends`: grads = "device", each unit's gradient goes out first
    (send_grads), pipelined with the update before; `start_s`: the device's own update of the resident units, which
    the next forward waits for. Returns how much later the head starts than the forward phase alone has it."""
    units = max(p.streamed_layers + p.embed_streamed + p.head_streamed, 1)
    u = max(pass_s / units, p.send_s if sends else 0.0)  # the walk's pace, unit by unit
    first = (p.send_s if sends else 0.0) + p.embed_streamed * u + p.load_s  # the first streamed layer: after these
    s, f = p.streamed_layers, p.layer_forward_s
    # the forward's end: its own compute, or the streamed layers gated by the walk (the last one where the walk is
    # slower than the forward, else the first)
    gated = first + max(u + s * f, s * u + f) if s else 0.0
    head_ready = first + (s + p.head_streamed) * u  # the head comes last in forward order
    return max(0.0, max(start_s + p.forward_s, gated, head_ready) - p.forward_s)


def speculated_backlog(p: Pipeline, pass_s: float) -> float:
    """The update beside the backward (Speculation): each streamed unit's update starts as its gradient lands in the
    arena, the head's first, then the layers from the top, the embedding's last (Executor._backward). Returns how long
    after the backward's end the pool finishes: pool-bound (every update queued from the first landing) or bound by
    the last unit to land (the embedding's, or the lowest streamed layer's, with its own update after it)."""
    first_land = p.layer_backward_s + p.send_s
    last_land = p.backward_s - p.resident_layers * p.layer_backward_s + p.send_s
    return max(first_land + pass_s, last_land + p.unit_update_s) - p.backward_s


def speculated(p: Pipeline, update: Update) -> float:
    """A speculated step that does not clip: the updates beside the backward are confirmed (Engine._settle). The
    next forward starts after the device's update of the resident units, runs the resident layers, then needs the
    unit the pool did last, and its weights' H2D. Returns the exposed update (the device's update at least)."""
    backlog = speculated_backlog(p, update.pool_s)
    return max(update.resident_s, backlog + p.load_s - p.resident_layers * p.layer_forward_s)


def rolled_back(p: Pipeline, update: Update, sends: bool) -> float:
    """A speculated step that clips: the driver waits for every update beside the backward (Engine._settle), then the
    pool's rollback pass (roll back + clipped redo, one pass: AdamWShard.settle) runs as the serial update does (grads =
    "device": each unit's gradient sent out of the GPU again first, send_grads)."""
    backlog = max(0.0, speculated_backlog(p, update.pool_s))
    return backlog + serial_exposed(p, update.rollback_s, sends, update.resident_s)


def gpu_cases(plan: MemoryPlan, config: ModelConfig, compute: Compute, h2d: float, d2h: float, update: Update
              ) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, Any]]]:
    """On a GPU: (each case's exposed update, each case's GPU time besides it, the phases). The
    copies run on streams of their own beside compute (Streams): the weights in, half for the forward and half for
    the backward (the top layers' stay between them), the gradients out during the backward, except under the serial
    update with grads = "device", where they wait on the GPU for the norm and go out beside the update."""
    held = plan.grads == "device"
    forward = max(compute.forward_s, h2d / 2)
    backward = {c: max(compute.backward_s, h2d / 2, 0.0 if held and c == "serial" else d2h) for c in CASES}
    p = pipeline(plan, config, forward, backward["speculated"], h2d, d2h, update)
    costs = {"speculated": speculated(p, update), "rolled back": rolled_back(p, update, held),
             "serial": serial_exposed(p, update.pool_s, held, update.resident_s)}
    busy = {c: forward + compute.head_s + backward[c] for c in CASES}

    def bound(s: float, parts: dict[str, float]) -> str:
        return next(name for name, t in parts.items() if t == s)

    b = backward["speculated"]
    phases = {"forward": {"s": forward, "bound": bound(forward, {"compute": compute.forward_s, "h2d": h2d / 2})},
              "head": {"s": compute.head_s, "bound": "compute"},
              "backward": {"s": b, "bound": bound(b, {"compute": compute.backward_s, "h2d": h2d / 2, "d2h": d2h})}}
    return costs, busy, phases  # the first streamed layer's load is inside each case's exposed update


def mix_cases(speculate: str, clip_rate: float, updates_after_step: bool) -> dict[str, float]:
    """How often each case runs (Engine._speculation): "on" speculates every step, "auto" every step after one that did
    not clip, "off" never; steps clip independently at `clip_rate`. Where the driver does not wait for the step
    (Engine.updates_after_step: clipping off, grads not on the device, one executor) every update is final as it
    lands: the speculated case, always."""
    if not updates_after_step:
        return {"speculated": 1.0, "rolled back": 0.0, "serial": 0.0}
    speculating = {"on": 1.0, "auto": 1.0 - clip_rate, "off": 0.0}[speculate]
    return {"speculated": speculating * (1 - clip_rate), "rolled back": speculating * clip_rate,
            "serial": 1.0 - speculating}


def predict(plan: MemoryPlan, config: ModelConfig, cal: Calibration, *, precision: str = "tf32",
            optimizer_workers: int = 2, clipping: bool = True, executors: int = 1, link_gbps: float = LINK_GBPS,
            speculate: str = "auto", clip_rate: float = 0.0, compiled: bool = False, kept_layers: int | None = None
            ) -> Prediction:
    """The step time of the run `plan` describes on the calibrated machine, with `executors` executors on each of
    plan.nodes nodes (docs/design.md#the-predicted-step). speculate: as EngineConfig.speculate; clip_rate: the share
    of steps assumed to clip (0 to 1); compiled: the run's layers run through torch.compile; kept_layers: None, the
    plan's (plan.kept)."""
    check_choice("speculate", speculate, SPECULATE)
    if not 0.0 <= clip_rate <= 1.0:
        raise ValueError(f"clip_rate is a share of steps, 0 to 1, got {clip_rate}")
    kept = min(len(plan.kept.indices) if kept_layers is None else kept_layers, config.num_layers)
    times = layer_times(plan, config, cal, precision, compiled)
    compute = compute_phases(plan, config, times, kept, resident_cast_s(plan, cal))
    h2d, d2h = copy_times(plan, cal)
    update = update_times(plan, cal, optimizer_workers)
    tokens = plan.step_tokens * executors * plan.nodes  # a step's, over every executor of the run
    data = tokens * cal.data_s_per_token  # one loader feeds every executor of the run
    network = plan.network_bytes / (link_gbps * 1e9)
    clip_rate = clip_rate if clipping else 0.0
    updates_after_step = clipping or plan.grads == "device" or executors * plan.nodes > 1
    shares = mix_cases(speculate, clip_rate, updates_after_step)
    fixed, fixed_source = fixed_costs(plan, config, cal, optimizer_workers)
    if not (plan.on_gpu and cal.h2d_gbps is not None):  # one set of cores for all of them
        costs = {"speculated": update.pool_s, "rolled back": update.pool_s + update.rollback_s,
                 "serial": update.pool_s}
        steps = {c: compute.total_s + update.resident_s + costs[c] + data + network + fixed[c] for c in CASES}
        phases: dict[str, dict[str, Any]] = {}
    else:
        costs, busy, phases = gpu_cases(plan, config, compute, h2d, d2h, update)
        steps = {c: max(busy[c] + costs[c], data) + network + fixed[c] for c in CASES}
    exposed_update = sum(shares[c] * costs[c] for c in CASES)
    step = sum(shares[c] * steps[c] for c in CASES)
    # the pool's update is hidden where the step waits for no more than the device's update of the resident units
    hidden = exposed_update - update.resident_s <= 1e-3 * step
    phases["update"] = {"s": update.pool_s, "exposed_s": exposed_update, "device_s": update.resident_s,
                        "bound": "hidden" if hidden else "optimizer (exposed)"}
    lanes = {"compute": compute.total_s, "h2d": h2d, "d2h": d2h, "optimizer": update.pool_s, "data": data,
             "network": network}
    exposed = {"h2d": max(0.0, h2d / 2 - compute.forward_s) + max(0.0, h2d / 2 - compute.backward_s),
               "d2h": max(0.0, d2h - max(compute.backward_s, h2d / 2)), "optimizer": exposed_update,
               "data": max(0.0, data - compute.total_s), "network": network}
    cases = {c: {"share": shares[c], "step_s": steps[c], "exposed_update_s": costs[c]} for c in CASES}
    return Prediction(compute.total_s, h2d, d2h, update.pool_s, data, sum(shares[c] * fixed[c] for c in CASES), step,
                      tokens / step, max(lanes, key=lambda name: lanes[name]), times.source, exposed, network,
                      update.resident_s, update.rollback_s, update.rate, speculate, clip_rate, kept, cases, phases,
                      fixed_source, compute.forward_s, compute.head_s + compute.backward_s)


@dataclass(frozen=True)
class StepPredictor:
    """Plans predicted by `predict` with these run settings (its keywords) on `cal`: what plan_run (step_time=) chooses
    by (the split of the GPU's spare memory between resident units and kept layers, the bf16 copy, the NVMe tier)."""

    config: ModelConfig
    cal: Calibration
    settings: dict[str, Any] = field(default_factory=dict)

    def __call__(self, plan: MemoryPlan) -> float:
        """The plan's predicted step, in seconds."""
        return predict(plan, self.config, self.cal, **self.settings).step_s

    def h2d_exposed(self, plan: MemoryPlan) -> float:
        """Seconds of the step's weight copies to the device beyond the forward's and the backward's compute they
        overlap with (0 where compute hides them; 0 on the CPU path, which copies nothing)."""
        return predict(plan, self.config, self.cal, **self.settings).exposed["h2d"]


def step_time(config: ModelConfig, cal: Calibration, **settings: Any) -> StepPredictor:
    """A plan's predicted step in seconds (and its exposed H2D), by `predict` with these run settings on `cal`."""
    return StepPredictor(config, cal, settings)


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
           max_workers: int | None = None, flags: dict[str, Any] | None = None, **plan_kwargs: Any) -> Choice | None:
    """The fastest predicted run among the settings left "auto" that fits memory (None: none fits).
    optimizer_workers: 1 .. max_workers (default: the cores of the machine `cal` was measured on, which `megatrain
    plan --calibration FILE` may run far from); grads: the placements clipping allows (the GPU's
    only on a GPU); tile_tokens: untiled, else the largest of TILE_TOKENS halved down to MIN_TILE_TOKENS (below the
    micro-batch's tokens) that fits. Micro-batches and the schedule are taken as given (plan_run picks the schedule
    where it is auto).
    Each candidate is planned and predicted as the run it stands for would be: with `flags` (predict's speculate,
    clip_rate, compiled, link_gbps), and, where resident units and kept layers are both "auto" (plan_kwargs), with
    the split of the GPU's spare memory predicted shortest for its own workers and placement (a search that split
    the memory by another rule, or predicted eager layers that never clip, picked a slower run than it printed)."""
    on_gpu = plan_kwargs.get("on_gpu", False)
    cores = cal.cores or os.cpu_count() or 1
    workers = (range(1, (max_workers or min(cores, MAX_CALIBRATED_WORKERS)) + 1) if optimizer_workers == AUTO
               else [int(optimizer_workers)])
    placements = ([g for g in GRAD_PLACEMENTS if g != AUTO and not (g == "stream" and clipping)
                   and not (g == "device" and not on_gpu)] if grads == AUTO else [grads])
    tokens = batch * seq
    tiles: list[int | None | str] = ([None] + [TILE_TOKENS >> i for i in range((TILE_TOKENS // MIN_TILE_TOKENS)
                                                                              .bit_length())
                                               if TILE_TOKENS >> i < tokens]
                                     if tile_tokens == AUTO and config.family.tiles else [tile_tokens])
    split = plan_kwargs.get("resident") == plan_kwargs.get("keep_activations") == AUTO
    best: Choice | None = None
    tried = 0
    for w in workers:
        settings = dict(flags or {}, precision=precision, optimizer_workers=w, clipping=clipping,
                        executors=plan_kwargs.get("executors", 1))
        split_by = step_time(config, cal, **settings) if split else None
        for g in placements:
            for tile in tiles:  # the largest tiles that fit (untiled first): a calibration times untiled layers
                # only, so tiles would be predicted free, and chosen where they only make room for resident units
                plan = plan_run(config, batch, seq, grads=g, clipping=clipping, precision=precision,
                                optimizer_workers=w, tile_tokens=tile, find_longest=False, step_time=split_by,
                                **plan_kwargs)
                if plan.host_problem() or plan.gpu_problem():
                    continue
                tried += 1
                pred = predict(plan, config, cal, **settings)
                # ties (the CPU path's lanes do not depend on the placement) go to the earlier, leaner candidate
                if best is None or pred.step_s < best.prediction.step_s * (1 - 1e-9):
                    best = Choice(plan, pred, w, 0)
                break
    if best is not None:
        best.tried = tried
    return best


__all__ = ["Choice", "Prediction", "StepPredictor", "choose", "predict", "step_time"]
