"""Ray metrics: EngineMetrics records from an actor, and a training run's series reach the Prometheus endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ray
from helpers import free_port

from actors.metrics import EngineMetrics
from megatrain.telemetry import StepStats

ROOT = Path(__file__).resolve().parents[1]


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


# Runs in its own process with its own Ray: the export port is a property of the Ray instance, and the
# session's Ray (tests/conftest.py) is started without one.
EXPORT_SCRIPT = textwrap.dedent("""
    import json, sys, time, urllib.request
    import ray

    port, expected = int(sys.argv[1]), json.loads(sys.argv[2])
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=port,
             object_store_memory=100 * 1024 * 1024, logging_level="ERROR")

    import megatrain, numpy as np

    # a real (tiny) training run: its driver records step metrics, its optimizer workers update
    engine = megatrain.Engine("tiny", device="cpu", precision="fp32", optimizer_workers=1, lr=1e-3)
    rng = np.random.default_rng(0)
    found, deadline = [], time.monotonic() + 90
    while time.monotonic() < deadline:
        engine.step(rng.integers(0, 256, (2, 32)))
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            body = ""
        found = sorted({line.split("{")[0].split(" ")[0] for line in body.splitlines()
                        if "megatrain_" in line and not line.startswith("#")})
        if all(any(f.endswith(name) for f in found) for name in expected):
            break
        time.sleep(0.5)
    engine.shutdown()
    print("RESULT " + json.dumps(found))
    ray.shutdown()
""")


# Ray puts "ray_" in front of every name, and "_total" after counters.
EXPECTED = ["megatrain_loss", "megatrain_step_seconds", "megatrain_wait_seconds", "megatrain_tflops",
            "megatrain_tokens_per_second", "megatrain_transfer_gbps", "megatrain_optimizer_queue_depth",
            "megatrain_steps_total", "megatrain_step_duration_seconds_bucket", "megatrain_arena_bytes",
            "megatrain_optimizer_update_seconds"]


def test_metrics_reach_the_prometheus_endpoint(tmp_path):
    script = tmp_path / "export.py"
    script.write_text(EXPORT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(script), str(free_port()), json.dumps(EXPECTED)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = json.loads(result[0][len("RESULT "):])
    for name in EXPECTED:
        assert any(f.endswith(name) for f in found), (name, found)
    assert all(f.startswith("ray_megatrain_") for f in found), found


def test_record_from_the_driver_with_nothing_moved(ray_session):
    m = EngineMetrics(run="driver")
    s = stats()
    s.h2d_bytes = s.d2h_bytes = 0  # Ray counters refuse an increment of 0: such steps must still record
    m.record_step(s, loss=1.0, tokens_per_s=0.0, tflops=0.0)
    m.record_optimizer(worker=0, update_seconds=0.0, queue_depth=0)
