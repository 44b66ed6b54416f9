"""Ray metrics: EngineMetrics records from an actor, from a task it travels to, and from the driver.

That a training run's series reach Ray's metrics endpoint, and Prometheus, is tested on a `ray start` cluster in
test_dashboard.py (one cluster start for both)."""

from __future__ import annotations

import threading
import time

import ray

from actors.metrics import EngineMetrics, write_session_dashboard
from megatrain.telemetry import WAIT_CAUSES, StepStats


def stats(step: int = 0) -> StepStats:
    return StepStats(step=step, step_time=1.0, compute=0.7, wait_weights=0.1, wait_optimizer=0.05,
                     wait_data=0.05, other=0.1, h2d_bytes=8 << 30, d2h_bytes=0, h2d_gbps=50.0, d2h_gbps=0.0,
                     overlap=0.9, stall_fraction=0.3)


def test_engine_metrics_record_in_an_actor(ray_session):
    engine = ray.remote(EngineMetrics).remote(run="t1", executor=1)
    ray.get([engine.record_step.remote(stats(0), 2.5, 1234.5, 100.0),
             engine.record_step.remote(stats(1), float("nan"), 0.0, 0.0),  # a NaN loss is left out, no error
             engine.record_optimizer.remote(3, 0.02, 2),
             engine.record_skipped_step.remote(),
             engine.record_arena.remote(123 << 20, "params")])


def test_engine_metrics_travel_to_a_task(ray_session):
    @ray.remote
    def use(metrics: EngineMetrics, s: StepStats) -> tuple[str, int]:
        metrics.record_step(s, loss=1.0, tokens_per_s=1.0, tflops=1.0)  # fresh Ray metrics, same tags
        return metrics.run, metrics.executor

    assert ray.get(use.remote(EngineMetrics(run="t2", executor=3), stats())) == ("t2", 3)


def test_record_from_the_driver_with_nothing_moved(ray_session):
    m = EngineMetrics(run="driver")
    s = stats()
    s.h2d_bytes = s.d2h_bytes = 0  # Ray counters refuse an increment of 0: such steps must still record
    m.record_step(s, loss=1.0, tokens_per_s=0.0, tflops=0.0)
    m.record_optimizer(worker=0, update_seconds=0.0, queue_depth=0)
    # every cause every step, a cause the step never waited for as 0: its series exists from the first step
    assert {cause: m.last(m.wait_seconds, cause=cause) for cause in (*WAIT_CAUSES, "other")} == {
        "weights": 0.1, "optimizer": 0.05, "gradients": 0.0, "data": 0.05, "other": 0.1}


def test_the_gauges_are_reported_again_between_steps_until_stop(ray_session):
    """Ray drops a gauge that is not set again within two report intervals: the driver's EngineMetrics sets the last
    values again from a thread of its own, which stop() ends and joins."""
    m = EngineMetrics(run="repeat")
    m.record_arena(1 << 20, "params")
    m.record_step(stats(), loss=2.0, tokens_per_s=10.0, tflops=1.0)
    m.start_repeating(every=0.01)
    m.start_repeating(every=0.01)  # once: a second call starts no second thread
    repeaters = [t for t in threading.enumerate() if t.name == "megatrain-metrics-repeat"]
    assert len(repeaters) == 1 and repeaters[0].daemon
    deadline = time.monotonic() + 30
    while m.repeats < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.repeats >= 2
    m.stop()
    assert not repeaters[0].is_alive()
    assert not [t for t in threading.enumerate() if t.name == "megatrain-metrics-repeat"]
    repeats = m.repeats
    m.stop()  # a second stop (Engine.shutdown after a failed start, then __exit__) is a no-op
    assert m.repeats == repeats and m.last(m.arena_bytes, kind="params") == float(1 << 20)
    assert m.last(m.loss) == 2.0 and m.last(m.loss, kind="nothing") is None


def test_no_dashboard_where_the_ray_session_has_no_grafana_folder(ray_session):
    # the session's Ray runs without its dashboard, which is what writes Ray's Grafana files: nothing to join
    assert write_session_dashboard() is None
