"""Ray metrics of a run: what Prometheus / Grafana (or `curl <node>:<metrics_export_port>/metrics`) sees.

Every name starts with `megatrain_`; Ray exports them with its own `ray_` in front (`ray_megatrain_loss`,
counters with `_total` after), from the metrics agent of each node every few seconds. Metrics are
per-process objects: each process that records (the driver, the executor, each optimizer worker) makes its
own EngineMetrics; pickling one (to hand it to an actor) makes a fresh one there with the same tags.

The driver also leaves megatrain's Grafana dashboard beside Ray's in the Ray session it joined
(`write_session_dashboard`), where Ray's Grafana provisioning loads it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import ray
from ray.util.metrics import Counter, Gauge, Histogram

from megatrain.telemetry import StepStats
from megatrain.telemetry import metric_specs as specs
from megatrain.telemetry.dashboard import write_into_ray_session
from megatrain.telemetry.metric_specs import BASE_TAGS, MetricSpec

log = logging.getLogger(__name__)


def make_metric(spec: MetricSpec, base: dict[str, str]) -> Gauge | Counter | Histogram:
    """The Ray metric of `spec`, its base tags (run, executor) set."""
    keys = BASE_TAGS + spec.tags
    if spec.kind == "histogram":
        metric = Histogram(spec.name, spec.doc, boundaries=list(spec.boundaries), tag_keys=keys)
    else:
        metric = {"gauge": Gauge, "counter": Counter}[spec.kind](spec.name, spec.doc, tag_keys=keys)
    return metric.set_default_tags(base)


class EngineMetrics:
    """Gauges, counters and histograms of one executor's steps and of the optimizer workers
    (megatrain/telemetry/metric_specs.py names them).

    Tags: run (a run id, so runs sharing a Prometheus stay apart), executor (several executors may share a
    pool), plus cause / direction / worker / kind where a metric has several series.
    """

    def __init__(self, run: str = "default", executor: int = 0):
        self.run, self.executor = run, executor
        base = {"run": run, "executor": str(executor)}
        self.step_seconds = make_metric(specs.STEP_SECONDS, base)
        self.step_seconds_hist = make_metric(specs.STEP_DURATION, base)
        self.compute_seconds = make_metric(specs.COMPUTE_SECONDS, base)
        self.wait_seconds = make_metric(specs.WAIT_SECONDS, base)
        self.stall_fraction = make_metric(specs.STALL_FRACTION, base)
        self.overlap_fraction = make_metric(specs.OVERLAP_FRACTION, base)
        self.transfer_gbps = make_metric(specs.TRANSFER_GBPS, base)
        self.transfer_bytes = make_metric(specs.TRANSFER_BYTES, base)
        self.tokens_per_second = make_metric(specs.TOKENS_PER_SECOND, base)
        self.tflops = make_metric(specs.TFLOPS, base)
        self.loss = make_metric(specs.LOSS, base)
        self.steps = make_metric(specs.STEPS, base)
        self.skipped_steps = make_metric(specs.SKIPPED_STEPS, base)
        self.update_seconds = make_metric(specs.UPDATE_SECONDS, base)
        self.update_seconds_hist = make_metric(specs.UPDATE_DURATION, base)
        self.queue_depth = make_metric(specs.QUEUE_DEPTH, base)
        self.arena_bytes = make_metric(specs.ARENA_BYTES, base)
        self.arena_sizes: dict[str, float] = {}  # kind -> bytes, set again with every step (see record_step)

    def __reduce__(self):
        return EngineMetrics, (self.run, self.executor)

    def record_step(self, stats: StepStats, loss: float, tokens_per_s: float, tflops: float) -> None:
        self.step_seconds.set(float(stats.step_time))
        self.step_seconds_hist.observe(float(stats.step_time))
        self.compute_seconds.set(float(stats.compute))
        for cause, value in (("weights", stats.wait_weights), ("optimizer", stats.wait_optimizer),
                             ("data", stats.wait_data), ("other", stats.other)):
            self.wait_seconds.set(float(value), tags={"cause": cause})
        self.stall_fraction.set(float(stats.stall_fraction))
        self.overlap_fraction.set(float(stats.overlap))
        for direction, gbps, nbytes in (("h2d", stats.h2d_gbps, stats.h2d_bytes),
                                        ("d2h", stats.d2h_gbps, stats.d2h_bytes)):
            self.transfer_gbps.set(float(gbps), tags={"direction": direction})
            if nbytes > 0:  # Ray counters refuse increments of 0
                self.transfer_bytes.inc(float(nbytes), tags={"direction": direction})
        self.tokens_per_second.set(float(tokens_per_s))
        self.tflops.set(float(tflops))
        if math.isfinite(loss):  # a NaN would hide the last good value on every dashboard
            self.loss.set(float(loss))
        self.steps.inc()
        # Ray drops a gauge that is not set again within two report intervals: the arena's size, known once at the
        # start, is repeated with every step so that it stays visible
        for kind, nbytes in self.arena_sizes.items():
            self.arena_bytes.set(nbytes, tags={"kind": kind})

    def record_skipped_step(self) -> None:
        self.skipped_steps.inc()

    def record_optimizer(self, worker: int, update_seconds: float, queue_depth: int) -> None:
        tags = {"worker": str(worker)}
        self.update_seconds.set(float(update_seconds), tags=tags)
        self.update_seconds_hist.observe(float(update_seconds), tags=tags)
        self.queue_depth.set(float(queue_depth), tags=tags)

    def record_arena(self, nbytes: int, kind: str = "total") -> None:
        self.arena_sizes[kind] = float(nbytes)
        self.arena_bytes.set(float(nbytes), tags={"kind": kind})


def write_session_dashboard() -> Path | None:
    """megatrain's Grafana dashboard into the dashboards folder of the Ray session this driver joined, beside Ray's
    (megatrain/telemetry/dashboard.py: write_into_ray_session); None where that session has none (a Ray started
    without its dashboard, this process not on the head node) or it cannot be written (said in one warning)."""
    node = getattr(ray._private.worker.global_worker, "node", None)  # set once ray.init has connected
    if node is None:
        return None
    try:
        path = write_into_ray_session(Path(node.get_session_dir_path()))
    except OSError as e:  # e.g. a cluster another user started: the run goes on without it
        log.warning("could not write megatrain's Grafana dashboard into the Ray session (%s)", e)
        return None
    if path is not None:
        log.debug("megatrain's Grafana dashboard: %s", path)
    return path
