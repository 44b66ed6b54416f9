"""The calibration cache, the step-time prediction's properties, `megatrain calibrate` and `plan --json`, and predicted
beside measured in the progress bar and the report. No timing is asserted: that is benchmarks/predict.py's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.memory.plan import plan_run
from megatrain.perf.calibrate import CACHE_ENV, Calibration, LayerTiming, calibrate, layer_key
from megatrain.perf.predict import auto_optimizer_workers, choose, predict
from pipelines.cli import main

GiB = 2**30


def gpu_calibration() -> Calibration:
    """A made-up H100-like machine: 50 GB/s each way, 400 TFLOP/s tf32, 1 G params/s per optimizer worker."""
    return Calibration(device="FakeGPU", host="h", created=0.0, cores=16, compute_threads=4, h2d_gbps=50.0,
                       d2h_gbps=50.0, memcpy_gbps=10.0, matmul_tflops={"tf32": 400.0, "fp32": 50.0, "bf16": 800.0},
                       adamw_gparams={str(w): float(w) for w in range(1, 9)})


def cpu_calibration() -> Calibration:
    return Calibration(device="cpu", host="h", created=0.0, cores=2, compute_threads=2, h2d_gbps=None, d2h_gbps=None,
                       memcpy_gbps=5.0, matmul_tflops={"fp32": 0.1, "tf32": 0.1}, adamw_gparams={"1": 1.0, "2": 1.2})


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(CACHE_ENV, str(path))
    return path


def test_calibration_cache_round_trip(cache: Path) -> None:
    cal = cpu_calibration()
    cal.layers["k"] = LayerTiming(0.01, 0.02)
    assert Calibration.load("cpu") is None  # nothing cached yet
    assert cal.save() == cache
    assert Calibration.load("cpu") == cal
    assert Calibration.load("NVIDIA H100") is None  # another device's calibration is not this one's
    cache.write_text("{not json")
    assert Calibration.load("cpu") is None


def test_calibrate_on_the_cpu_quickly(cache: Path) -> None:
    tiny = ModelConfig.from_name("tiny")
    cal = calibrate("cpu", tiny, batch=1, seq=32, max_seconds=3)
    assert cal.device == "cpu" and cal.h2d_gbps is None and cal.memcpy_gbps > 0
    assert cal.matmul_tflops["fp32"] > 0 and cal.matmul_tflops["tf32"] == cal.matmul_tflops["fp32"]
    assert set(cal.adamw_gparams) == {str(w) for w in range(1, len(cal.adamw_gparams) + 1)}
    assert all(rate > 0 for rate in cal.adamw_gparams.values())
    timing = cal.layers[layer_key(tiny, 1, 32, "tf32")]
    assert timing.layer_s >= 0 and timing.rest_s >= 0
    plan = plan_run(tiny, 1, 32, on_gpu=False, find_longest=False)
    assert predict(plan, tiny, cal).compute_source == "measured layers"
    # a later calibration keeps the layer timings of other shapes
    again = calibrate("cpu", None, max_seconds=1, base=cal)
    assert again.layers == cal.layers


def test_layers_timed_on_simulated_streams_from_compute_spans() -> None:
    """Where copies run on streams of their own (a GPU; here the CPU's simulation of one) the layers' times are the
    compute stream's spans, so that the weights' round trip through unregistered memory is not counted as compute
    (on the H100 it made a 7B layer read 10x its compute)."""
    from megatrain.perf.calibrate import time_layers

    tiny = ModelConfig.from_name("tiny")
    layer, rest = time_layers(tiny, 1, 32, device="cpu-async:3", budget_s=30)
    assert layer > 0 and rest > 0


def test_layer_major_pcie_time_falls_as_one_over_k() -> None:
    config, cal = ModelConfig.from_name("1b"), gpu_calibration()
    per_token = {}
    for k in (1, 2, 4):
        plan = plan_run(config, 1, 2048, on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, micro_batches=k,
                        schedule="layer-major", find_longest=False)
        pred = predict(plan, config, cal, optimizer_workers=8)
        per_token[k] = (pred.h2d_s + pred.d2h_s) / plan.step_tokens
        assert pred.compute_s == pytest.approx(k * predict(replace(plan, micro_batches=1), config, cal).compute_s)
        assert pred.tokens_per_s == pytest.approx(plan.step_tokens / pred.step_s)
    # weights and gradients cross once a step: only the embedding rows grow with the tokens
    assert per_token[2] == pytest.approx(per_token[1] / 2, rel=0.02)
    assert per_token[4] == pytest.approx(per_token[1] / 4, rel=0.02)
    per_micro = plan_run(config, 1, 2048, on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, micro_batches=4,
                         schedule="per-micro-batch", find_longest=False)
    assert predict(per_micro, config, cal).h2d_s > 3 * per_token[1] * per_micro.step_tokens / 4


def test_bound_is_the_biggest_lane_and_the_step_covers_it() -> None:
    config = ModelConfig.from_name("1b")
    plan = plan_run(config, 1, 512, on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, find_longest=False)
    for cal in (gpu_calibration(), replace(gpu_calibration(), h2d_gbps=0.5),
                replace(gpu_calibration(), adamw_gparams={"1": 0.01})):
        pred = predict(plan, config, cal, optimizer_workers=1)
        lanes = {"compute": pred.compute_s, "h2d": pred.h2d_s, "d2h": pred.d2h_s, "optimizer": pred.optimizer_s,
                 "data": pred.data_s}
        assert pred.bound == max(lanes, key=lanes.get)
        assert pred.step_s >= max(lanes.values())
    assert predict(plan, config, replace(gpu_calibration(), h2d_gbps=0.5)).bound == "h2d"
    # clipping on, the update overlaps the next forward only; off, the rest of the step too
    slow_optimizer = replace(gpu_calibration(), adamw_gparams={"1": 0.3})
    on = predict(plan, config, slow_optimizer, optimizer_workers=1, clipping=True)
    off = predict(replace(plan, grads="stream"), config, slow_optimizer, optimizer_workers=1, clipping=False)
    assert off.step_s <= on.step_s


def test_the_cpu_path_adds_its_lanes_up() -> None:
    tiny, cal = ModelConfig.from_name("tiny"), cpu_calibration()
    plan = plan_run(tiny, 2, 64, on_gpu=False, find_longest=False)
    cal.layers[layer_key(tiny, 2, 64, "tf32")] = LayerTiming(0.01, 0.005)
    pred = predict(plan, tiny, cal, optimizer_workers=2)
    assert pred.compute_source == "measured layers"
    assert pred.compute_s == pytest.approx(tiny.num_layers * 0.01 + 0.005)
    assert pred.h2d_s == pred.d2h_s == 0.0
    assert pred.optimizer_s == pytest.approx(tiny.num_params() / 1.2e9)
    assert pred.step_s == pytest.approx(pred.compute_s + pred.optimizer_s + pred.data_s + pred.overhead_s)


def test_choose_picks_the_fastest_candidate_that_fits() -> None:
    config, cal = ModelConfig.from_name("1b"), gpu_calibration()
    kwargs = dict(on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB)
    choice = choose(config, 1, 2048, cal, clipping=False, max_workers=8, **kwargs)
    assert choice is not None and choice.tried > 1
    for w in (1, 4, 8):
        plan = plan_run(config, 1, 2048, grads="stream", clipping=False, optimizer_workers=w, find_longest=False,
                        **kwargs)
        assert choice.prediction.step_s <= predict(plan, config, cal, optimizer_workers=w, clipping=False).step_s
    assert choose(config, 1, 2048, cal, on_gpu=True, gpu_free=1 * GiB, host_free=1 * GiB) is None  # nothing fits


def test_plan_json_and_calibrate_command(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipelines.train import TrainConfig

    train = TrainConfig()
    cal = cpu_calibration()
    key = layer_key(ModelConfig.from_name(train.model), train.data.batch_size, train.data.seq_len, train.precision)
    cal.layers[key] = LayerTiming(0.01, 0.005)
    cal.save()
    assert main(["plan", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"predicted_step_s", "predicted_tokens_per_s", "bound", "plan", "fits"} <= set(out)
    assert out["bound"] in ("compute", "h2d", "d2h", "optimizer", "data") and out["fits"]
    assert out["predicted_tokens_per_s"] == pytest.approx(out["plan"]["step_tokens"] / out["predicted_step_s"])
    assert main(["plan", "--device", "cpu"]) == 0  # with a calibration cached, the plain plan predicts too
    assert "predicted step:" in capsys.readouterr().out
    assert main(["plan", "--device", "cpu", "--optimizer-workers", "auto"]) == 0
    assert "--optimizer-workers" in capsys.readouterr().out
    assert main(["calibrate", "--device", "cpu", "--max-seconds", "1", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["path"] == str(cache) and key in Calibration.load("cpu").layers  # the earlier entry kept


def test_predicted_beside_measured(tmp_path: Path) -> None:
    from megatrain.telemetry import STEPS_FILE, StepStats, append_step
    from megatrain.telemetry.report import PREDICTION_FILE, report
    from pipelines.engine import StepResult
    from pipelines.train import _progress_fields

    result = StepResult(step=0, loss=1.0, tokens=100, grad_norm=1.0, lr=1e-3, skipped=False)
    fields = _progress_fields(result, 0.5, 1e6, 0, predicted=0.4)
    assert fields["pred s"] == "0.4" and fields["step s"] == "0.5"
    assert "pred s" not in _progress_fields(result, 0.5, 1e6, 0)
    for step in range(3):
        append_step(StepStats(step, 0.5, 0.4, 0.0, 0.0, 0.0, 0.1, 0, 0, 0.0, 0.0, 0.0, 0.2), tmp_path / STEPS_FILE)
    assert "predicted step" not in report(tmp_path)
    (tmp_path / PREDICTION_FILE).write_text(json.dumps({"predicted_step_s": 0.4, "bound": "compute",
                                                        "compute_s": 0.3}))
    assert "predicted step 400.0 ms (bound by compute" in report(tmp_path)
    assert "predicted / measured 0.80" in report(tmp_path)


def test_auto_optimizer_workers() -> None:
    """One per free CPU less the GPU executors' host threads (at least one, at most 16); with a calibration, the
    fewest that reach its best AdamW rate."""
    assert auto_optimizer_workers(2.0) == 2 and auto_optimizer_workers(64.0) == 16
    assert auto_optimizer_workers(16.0, reserved_cpus=8) == 8 and auto_optimizer_workers(2.0, reserved_cpus=4) == 1
    assert auto_optimizer_workers(16.0, cal=gpu_calibration()) == 8  # measured up to 8: more gain nothing
    flat = replace(cpu_calibration(), adamw_gparams={"1": 1.0, "2": 1.2, "4": 1.2})
    assert auto_optimizer_workers(8.0, cal=flat) == 2


def test_engine_takes_auto_optimizer_workers(ray_session: None) -> None:
    import megatrain

    with megatrain.Engine("tiny", optimizer_workers="auto", device="cpu", batch_size=2, seq_len=16) as engine:
        assert engine.engine_config.optimizer_workers == len(engine.workers) == 2  # the session's 2 CPUs, uncalibrated
        engine.step(torch.randint(0, 256, (2, 16)))
