"""A step's fixed costs, measured through Ray: what megatrain/perf/predict.py's fixed_costs adds to a step beyond its
compute, copies and update, which an in-process timing of the layers cannot see.

    costs = measure_step_costs(cal)        # `megatrain calibrate` runs it: a private Ray, ~20 s on 2 cores
    cal = replace(cal, step_fixed_s=costs.step_fixed_s, unit_message_s=costs.unit_message_s)

Two probe models give a cost a step and a cost a unit message (docs/design.md#step-costs)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import ray

from megatrain.config import ModelConfig
from megatrain.perf.calibrate import Calibration, executor_steps

PROBE = dict(vocab_size=260, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROBE_LAYERS = (1, 8)
PROBE_BATCH, PROBE_SEQ, PROBE_PRECISION = 1, 16, "fp32"
NEVER_CLIPS = 1e9  # clipping on (the driver validates the norm, as by default) at a norm no step reaches


@dataclass
class Probe:
    layers: int
    messages: int  # the unit messages a step sends (predict.fixed_costs counts them alike)
    measured_s: float  # the median step
    predicted_s: float  # the probe's step without fixed costs: in-process compute and the update

    @property
    def residual_s(self) -> float:
        return self.measured_s - self.predicted_s


@dataclass
class StepCosts:
    step_fixed_s: float
    unit_message_s: float
    probes: list[Probe]


def measure_step_costs(cal: Calibration, steps: int = 20, warmup: int = 5, workers: int = 2) -> StepCosts:
    """The fixed costs of a step on this machine (docs/design.md#step-costs), in a private Ray unless one runs in
    this process already. `cal`: this machine's calibration (the probes' updates at its optimizer pool's rate)."""
    from pipelines.cluster import init_ray

    started = not ray.is_initialized()
    init_ray("local")
    try:
        probes = [run_probe(layers, cal, steps, warmup, workers) for layers in PROBE_LAYERS]
    finally:
        if started:
            ray.shutdown()
    one, many = probes
    per_message = max((many.residual_s - one.residual_s) / (many.messages - one.messages), 0.0)
    return StepCosts(max(one.residual_s - one.messages * per_message, 0.0), per_message, probes)


def run_probe(layers: int, cal: Calibration, steps: int, warmup: int, workers: int) -> Probe:
    """One probe model's step as an Engine runs it beside the same model's in an in-process Executor, step by step
    in turn (a load that comes and goes on shared cores falls on both alike): the medians from `warmup` on."""
    from pipelines.engine import Engine

    config = ModelConfig(num_layers=layers, **PROBE)
    engine = Engine(config, optimizer_workers=workers, precision=PROBE_PRECISION, device="cpu",
                    max_grad_norm=NEVER_CLIPS, batch_size=PROBE_BATCH, seq_len=PROBE_SEQ, metrics=False)
    measured, local = [], []
    try:
        ids = np.random.default_rng(0).integers(0, config.vocab_size, (PROBE_BATCH, PROBE_SEQ))
        batch = ray.put({"input_ids": ids})
        with executor_steps(config, PROBE_BATCH, PROBE_SEQ, "cpu", PROBE_PRECISION) as (local_step, _):
            for _ in range(warmup + steps):
                t0 = time.monotonic()
                engine.step_batch(batch)
                measured.append(time.monotonic() - t0)
                local.append(local_step().wall_s)
    finally:
        engine.shutdown()
    update = config.num_params() / (cal.adamw_rate(workers) * 1e9)
    return Probe(layers, (layers + 2) * workers, statistics.median(measured[warmup:]),
                 statistics.median(local[warmup:]) + update)


__all__ = ["StepCosts", "measure_step_costs"]
