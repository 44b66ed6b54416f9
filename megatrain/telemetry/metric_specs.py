"""The Ray metrics megatrain records, as data: name, kind, help, tags, buckets.

actors/metrics.py makes the Ray metrics from these; the Grafana dashboard (megatrain/telemetry/dashboard.py) builds
its queries from them. One list for both, so that a renamed metric cannot leave a panel querying nothing. No Ray
here: the dashboard is built where Ray is not imported (`megatrain dashboard --out`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Tags every metric carries: runs sharing a Prometheus stay apart, and several executors may share a pool.
BASE_TAGS = ("run", "executor")

# Step time buckets from 10 ms (a tiny model) to 10 min (a 70B step on a slow host).
STEP_SECONDS_BOUNDARIES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0)
UPDATE_SECONDS_BOUNDARIES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as recorded: megatrain_...
    kind: str  # "gauge", "counter" or "histogram"
    doc: str
    tags: tuple[str, ...] = ()  # beyond BASE_TAGS
    boundaries: tuple[float, ...] = ()  # a histogram's buckets

    @property
    def series(self) -> str:
        """The name Prometheus stores: Ray puts `ray_` in front, and `_total` after a counter's name (a histogram's
        series add `_bucket`, `_sum` and `_count` to this)."""
        return f"ray_{self.name}" + ("_total" if self.kind == "counter" else "")


STEP_SECONDS = MetricSpec("megatrain_step_seconds", "gauge", "Wall time of the last step (s).")
STEP_DURATION = MetricSpec("megatrain_step_duration_seconds", "histogram", "Step wall times (s).",
                           boundaries=STEP_SECONDS_BOUNDARIES)
COMPUTE_SECONDS = MetricSpec("megatrain_compute_seconds", "gauge", "Compute busy time of the last step (s).")
WAIT_SECONDS = MetricSpec("megatrain_wait_seconds", "gauge", "Compute idle time of the last step by cause: weights, "
                          "optimizer, gradients, data, other (s).", ("cause",))
STALL_FRACTION = MetricSpec("megatrain_stall_fraction", "gauge", "1 - compute / step time of the last step.")
OVERLAP_FRACTION = MetricSpec("megatrain_overlap_fraction", "gauge",
                              "Fraction of the last step's transfer time hidden under compute.")
TRANSFER_GBPS = MetricSpec("megatrain_transfer_gbps", "gauge", "Achieved PCIe bandwidth by direction (GB/s).",
                           ("direction",))
TRANSFER_BYTES = MetricSpec("megatrain_transfer_bytes", "counter", "Bytes moved by direction.", ("direction",))
TOKENS_PER_SECOND = MetricSpec("megatrain_tokens_per_second", "gauge", "Training throughput (tokens/s).")
TFLOPS = MetricSpec("megatrain_tflops", "gauge", "Model TFLOP/s (6 N per token plus attention, as the benchmarks "
                    "count).")
LOSS = MetricSpec("megatrain_loss", "gauge", "Training loss of the last step.")
STEPS = MetricSpec("megatrain_steps", "counter", "Steps run.")
SKIPPED_STEPS = MetricSpec("megatrain_skipped_steps", "counter", "Steps skipped (non-finite loss or grads).")
ROLLBACKS = MetricSpec("megatrain_rollbacks", "gauge", "Steps of the run so far whose updates beside the backward "
                       "were rolled back (the step clipped, or a gradient was not finite).")
UPDATE_SECONDS = MetricSpec("megatrain_optimizer_update_seconds", "gauge",
                            "Last layer update time of an optimizer worker (s).", ("worker",))
UPDATE_DURATION = MetricSpec("megatrain_optimizer_update_duration_seconds", "histogram",
                             "Layer update times of the optimizer workers (s).", ("worker",),
                             UPDATE_SECONDS_BOUNDARIES)
QUEUE_DEPTH = MetricSpec("megatrain_optimizer_queue_depth", "gauge", "Units handed to an optimizer worker and not yet "
                         "updated, as it starts an update.", ("worker",))
ARENA_BYTES = MetricSpec("megatrain_arena_bytes", "gauge", "Bytes of the shared-memory arena by kind.", ("kind",))

POST_TRAINING = MetricSpec("megatrain_post_training", "gauge", "The last step's post-training metrics by name "
                           "(TRL's: reward, reward_std, kl, clip_ratio/region_mean, completions/mean_length, "
                           "rewards/accuracies, rewards/margins, ...; pipelines/dpo.py, pipelines/grpo.py).",
                           ("metric",))

METRICS = (STEP_SECONDS, STEP_DURATION, COMPUTE_SECONDS, WAIT_SECONDS, STALL_FRACTION, OVERLAP_FRACTION, TRANSFER_GBPS,
           TRANSFER_BYTES, TOKENS_PER_SECOND, TFLOPS, LOSS, STEPS, SKIPPED_STEPS, ROLLBACKS, UPDATE_SECONDS,
           UPDATE_DURATION, QUEUE_DEPTH, ARENA_BYTES, POST_TRAINING)
