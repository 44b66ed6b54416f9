"""The driver's wait for a step's batch is the step's data wait (pipelines/engine.py: step_once): a data loader
slower than the step shows in steps.jsonl, `megatrain report`, the trace, the progress line's stall and the Ray
metric; a batch that is already there adds next to nothing. No timed assertions beyond "a deliberate sleep shows
up as at least half of it"."""

from __future__ import annotations

import json
import time

import numpy as np
import ray

import megatrain
from megatrain.data import DataConfig
from megatrain.telemetry import STEPS_FILE, TRACE_FILE, read_chrome_trace
from megatrain.telemetry.report import report
from pipelines import train

DELAY = 0.4  # seconds the slow loader sleeps before each batch
ROWS, SEQ = 2, 32


@ray.remote(num_cpus=0)
class SlowLoader:
    """The data-loader actor's interface (next_batch, state_dict) over random batches, each `delay` seconds late."""

    def __init__(self, delay: float) -> None:
        self.delay, self.rng = delay, np.random.default_rng(0)

    def next_batch(self) -> dict[str, np.ndarray]:
        time.sleep(self.delay)
        return {"input_ids": self.rng.integers(0, 256, (ROWS, SEQ))}

    def state_dict(self, unconsumed: int = 0) -> dict:
        return {}


def test_a_slow_loader_is_a_data_wait_and_a_ready_batch_is_none(ray_session, tmp_path, capsys) -> None:
    cfg = train.TrainConfig(steps=1, out_dir=str(tmp_path), checkpoint_every=0, save_final=False, trace=True,
                            log_every=1, data=DataConfig(batch_size=ROWS, seq_len=SEQ))
    with megatrain.Engine("tiny", device="cpu", precision="fp32", optimizer_workers=1, batch_size=ROWS, seq_len=SEQ,
                          trace=True) as engine:
        loader = SlowLoader.options(scheduling_strategy=engine.scheduling_strategy).remote(DELAY)
        train._loop(cfg, engine, loader, tmp_path, 0, [])  # the training loop, on this loader
        slow_metric = engine.metrics.last(engine.metrics.wait_seconds, cause="data")
        ready = engine.step_batch({"input_ids": np.random.default_rng(1).integers(0, 256, (ROWS, SEQ))})
        ready_metric = engine.metrics.last(engine.metrics.wait_seconds, cause="data")
        ray.kill(loader)

    # its batch asked for just before the step: the step waited for the loader's whole sleep
    stats = json.loads((tmp_path / STEPS_FILE).read_text().splitlines()[0])["stats"]
    assert stats["wait_data"] >= DELAY / 2 and slow_metric == stats["wait_data"]
    assert stats["stall_fraction"] >= stats["wait_data"] / stats["step_time"]
    parts = ("compute", "wait_weights", "wait_optimizer", "wait_gradients", "wait_data", "other")
    assert abs(sum(stats[p] for p in parts) - stats["step_time"]) < 1e-9
    assert f"stall {100 * stats['stall_fraction']:.0f}%" in capsys.readouterr().out  # the progress line's
    row = report(tmp_path).splitlines()[1].split()  # step, time, compute, w.weights, w.optim, w.grads, w.data
    assert row[0] == "0" and float(row[6]) >= 1e3 * DELAY / 2
    waits = [s for s in read_chrome_trace(tmp_path / TRACE_FILE) if s.lane == "wait" and s.name == "data"]
    window = next(s for s in read_chrome_trace(tmp_path / TRACE_FILE) if s.lane == "step")
    assert any(s.duration >= DELAY / 2 and window.start <= s.start < s.end <= window.end for s in waits)

    # a batch already in the object store: no wait worth the name
    assert ready.stats["wait_data"] < DELAY / 10 and ready_metric == ready.stats["wait_data"]
