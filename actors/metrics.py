"""Ray metrics of a run: what Prometheus / Grafana (or `curl <node>:<metrics_export_port>/metrics`) sees.

Every name starts with `megatrain_`; Ray exports them with its own `ray_` in front (`ray_megatrain_loss`,
counters with `_total` after), from the metrics agent of each node every few seconds. Metrics are
per-process objects: each process that records (the driver, the executor, each optimizer worker) makes its
own EngineMetrics; pickling one (to hand it to an actor) makes a fresh one there with the same tags.
"""

from __future__ import annotations

import math

from ray.util.metrics import Counter, Gauge, Histogram

from megatrain.telemetry import StepStats

# Step time buckets from 10 ms (a tiny model) to 10 min (a 70B step on a slow host).
STEP_SECONDS_BOUNDARIES = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0]
UPDATE_SECONDS_BOUNDARIES = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]


class EngineMetrics:
    """Gauges, counters and histograms of one executor's steps and of the optimizer workers.

    Tags: run (a run id, so runs sharing a Prometheus stay apart), executor (several executors may share a
    pool), plus cause / direction / worker / kind where a metric has several series.
    """

    def __init__(self, run: str = "default", executor: int = 0):
        self.run, self.executor = run, executor
        base = {"run": run, "executor": str(executor)}
        keys = tuple(base)

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(name, doc, tag_keys=keys + extra).set_default_tags(base)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, tag_keys=keys + extra).set_default_tags(base)

        def histogram(name: str, doc: str, bounds: list[float], *extra: str) -> Histogram:
            return Histogram(name, doc, boundaries=bounds, tag_keys=keys + extra).set_default_tags(base)

        self.step_seconds = gauge("megatrain_step_seconds", "Wall time of the last step (s).")
        self.step_seconds_hist = histogram("megatrain_step_duration_seconds", "Step wall times (s).",
                                           STEP_SECONDS_BOUNDARIES)
        self.compute_seconds = gauge("megatrain_compute_seconds", "Compute busy time of the last step (s).")
        self.wait_seconds = gauge("megatrain_wait_seconds", "Compute idle time of the last step by cause: "
                                  "weights, optimizer, data, other (s).", "cause")
        self.stall_fraction = gauge("megatrain_stall_fraction", "1 - compute / step time of the last step.")
        self.overlap_fraction = gauge("megatrain_overlap_fraction",
                                      "Fraction of the last step's transfer time hidden under compute.")
        self.transfer_gbps = gauge("megatrain_transfer_gbps", "Achieved PCIe bandwidth by direction (GB/s).",
                                   "direction")
        self.transfer_bytes = counter("megatrain_transfer_bytes", "Bytes moved by direction.", "direction")
        self.tokens_per_second = gauge("megatrain_tokens_per_second", "Training throughput (tokens/s).")
        self.tflops = gauge("megatrain_tflops",
                            "Model TFLOP/s (6 N per token plus attention, as the benchmarks count).")
        self.loss = gauge("megatrain_loss", "Training loss of the last step.")
        self.steps = counter("megatrain_steps", "Steps run.")
        self.skipped_steps = counter("megatrain_skipped_steps", "Steps skipped (non-finite loss or grads).")
        self.update_seconds = gauge("megatrain_optimizer_update_seconds",
                                    "Last layer update time of an optimizer worker (s).", "worker")
        self.update_seconds_hist = histogram("megatrain_optimizer_update_duration_seconds",
                                             "Layer update times of the optimizer workers (s).",
                                             UPDATE_SECONDS_BOUNDARIES, "worker")
        self.queue_depth = gauge("megatrain_optimizer_queue_depth",
                                 "Units handed to an optimizer worker and not yet updated, as it starts an update.",
                                 "worker")
        self.arena_bytes = gauge("megatrain_arena_bytes", "Bytes of the shared-memory arena by kind.", "kind")

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

    def record_skipped_step(self) -> None:
        self.skipped_steps.inc()

    def record_optimizer(self, worker: int, update_seconds: float, queue_depth: int) -> None:
        tags = {"worker": str(worker)}
        self.update_seconds.set(float(update_seconds), tags=tags)
        self.update_seconds_hist.observe(float(update_seconds), tags=tags)
        self.queue_depth.set(float(queue_depth), tags=tags)

    def record_arena(self, nbytes: int, kind: str = "total") -> None:
        self.arena_bytes.set(float(nbytes), tags={"kind": kind})
