"""Ray metrics of a run: what Prometheus / Grafana (or `curl <node>:<metrics_export_port>/metrics`) sees.

Every name starts with `megatrain_` (Ray adds `ray_`); each recording process makes its own EngineMetrics, and the
driver's sets its gauges again from a thread so long steps still show. See docs/design.md#metrics."""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path

import ray
from ray.util.metrics import Counter, Gauge, Histogram

from megatrain.telemetry import WAIT_CAUSES, StepStats
from megatrain.telemetry import metric_specs as specs
from megatrain.telemetry.dashboard import write_into_ray_session
from megatrain.telemetry.metric_specs import BASE_TAGS, MetricSpec

log = logging.getLogger(__name__)

REPEAT_SECONDS = 5.0  # the most time between re-reports of the gauges: half Ray's default report interval


def repeat_interval() -> float:
    """Seconds between re-reports of the gauges: half of Ray's report interval where this process's environment
    sets one (RAY_metrics_report_interval_ms), at most REPEAT_SECONDS."""
    try:
        interval = float(os.environ.get("RAY_metrics_report_interval_ms", "")) / 1e3
    except ValueError:
        return REPEAT_SECONDS
    return min(REPEAT_SECONDS, max(interval / 2, 0.1))


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
        self.rollbacks = make_metric(specs.ROLLBACKS, base)
        self.update_seconds = make_metric(specs.UPDATE_SECONDS, base)
        self.update_seconds_hist = make_metric(specs.UPDATE_DURATION, base)
        self.queue_depth = make_metric(specs.QUEUE_DEPTH, base)
        self.arena_bytes = make_metric(specs.ARENA_BYTES, base)
        self.post_training = make_metric(specs.POST_TRAINING, base)
        # every gauge's last value, by (gauge, tags): what the repeater sets again
        self._last: dict[tuple[int, tuple[tuple[str, str], ...]], tuple[Gauge, float, dict[str, str] | None]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._repeater: threading.Thread | None = None
        self.repeats = 0  # times the repeater set the gauges again

    def __reduce__(self):
        return EngineMetrics, (self.run, self.executor)

    def _set(self, gauge: Gauge, value: float, tags: dict[str, str] | None = None) -> None:
        with self._lock:  # under the repeater's lock: it cannot set a value older than this one after it
            gauge.set(value, tags=tags)
            self._last[id(gauge), tuple(sorted((tags or {}).items()))] = (gauge, value, tags)

    def last(self, gauge: Gauge, **tags: str) -> float | None:
        """The value `gauge` (with `tags`) was last set to here; None if it was not."""
        with self._lock:
            entry = self._last.get((id(gauge), tuple(sorted(tags.items()))))
        return None if entry is None else entry[1]

    def record_step(self, stats: StepStats, loss: float, tokens_per_s: float, tflops: float) -> None:
        self._set(self.step_seconds, float(stats.step_time))
        self.step_seconds_hist.observe(float(stats.step_time))
        self._set(self.compute_seconds, float(stats.compute))
        # every cause every step, 0 included: a cause this run never waits for still has its series
        for cause in WAIT_CAUSES:
            self._set(self.wait_seconds, float(getattr(stats, f"wait_{cause}")), {"cause": cause})
        self._set(self.wait_seconds, float(stats.other), {"cause": "other"})
        self._set(self.stall_fraction, float(stats.stall_fraction))
        self._set(self.overlap_fraction, float(stats.overlap))
        for direction, gbps, nbytes in (("h2d", stats.h2d_gbps, stats.h2d_bytes),
                                        ("d2h", stats.d2h_gbps, stats.d2h_bytes)):
            self._set(self.transfer_gbps, float(gbps), {"direction": direction})
            if nbytes > 0:  # Ray counters refuse increments of 0
                self.transfer_bytes.inc(float(nbytes), tags={"direction": direction})
        self._set(self.tokens_per_second, float(tokens_per_s))
        self._set(self.tflops, float(tflops))
        if math.isfinite(loss):  # a NaN would hide the last good value on every dashboard
            self._set(self.loss, float(loss))
        self.steps.inc()

    def record_post(self, values: dict[str, float]) -> None:
        """A post-training step's metrics (pipelines/post_run.py), one series a name; non-finite ones left out."""
        for name, value in values.items():
            if math.isfinite(value):
                self._set(self.post_training, float(value), {"metric": name})

    def record_skipped_step(self) -> None:
        self.skipped_steps.inc()

    def record_rollbacks(self, total: int) -> None:
        self._set(self.rollbacks, float(total))  # every step, 0 included: the series exists from the first

    def record_optimizer(self, worker: int, update_seconds: float, queue_depth: int) -> None:
        tags = {"worker": str(worker)}
        self._set(self.update_seconds, float(update_seconds), tags)
        self.update_seconds_hist.observe(float(update_seconds), tags=tags)
        self._set(self.queue_depth, float(queue_depth), tags)

    def record_arena(self, nbytes: int, kind: str = "total") -> None:
        self._set(self.arena_bytes, float(nbytes), {"kind": kind})  # known once, at the start: the repeater keeps it

    # ---- the repeater ----
    def start_repeating(self, every: float | None = None) -> None:
        """Sets every gauge's last value again every `every` seconds (default: repeat_interval()) from a daemon
        thread, until stop(). Once per process that records between long pauses (the driver: the Engine)."""
        if self._repeater is not None:
            return
        self._stopping.clear()
        self._repeater = threading.Thread(target=self._repeat, args=(every or repeat_interval(),),
                                          name=f"megatrain-metrics-{self.run}", daemon=True)
        self._repeater.start()

    def _repeat(self, every: float) -> None:
        while not self._stopping.wait(every):
            try:
                with self._lock:
                    for gauge, value, tags in self._last.values():
                        gauge.set(value, tags=tags)
            except Exception as e:  # noqa: BLE001 - Ray gone from under a run that did not stop us: said once
                log.warning("stopped re-reporting megatrain's gauges to Ray (%s)", e)
                return
            self.repeats += 1

    def stop(self) -> None:
        """Stops the repeater thread and waits for it to end; nothing where none runs."""
        if self._repeater is None:
            return
        self._stopping.set()
        self._repeater.join()
        self._repeater = None


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
