"""One resolved plan per run (pipelines/run_plan.py: resolve): `megatrain plan --json` prints the RunPlan that
`megatrain train` with the same flags runs and writes to OUT/plan.json, its "auto"s decided the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.config import ModelConfig
from megatrain.perf.calibrate import CACHE_ENV, Calibration, LayerTiming, layer_key
from megatrain.run_plan import PLAN_FILE, UPDATES
from pipelines.cli import main

FLAG_SETS = {
    # the defaults' autos: grads, tiles, budget, resident units, kept layers, executors, compile, speculation
    "autos": ["--optimizer-workers", "1"],
    # no clipping: gradients stream and each update is final as it lands; micro-batches auto
    "unclipped": ["--optimizer-workers", "2", "--max-grad-norm", "0", "--micro-batches", "auto"],
    # every auto given: layer-major micro-batches, untiled, resident units and kept layers on the CPU path
    "given": ["--optimizer-workers", "1", "--micro-batches", "2", "--schedule", "layer-major", "--tile-tokens", "none",
              "--grads", "device", "--resident", "1", "--keep-activations", "1", "--compile", "off", "--speculate",
              "on", "--precision", "fp32"],
}


@pytest.fixture
def calibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU calibration with the tiny model's layer (plan --json measures one where none is cached)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "calibration.json"))
    cal = Calibration(device="cpu", host="h", created=0.0, cores=2, compute_threads=2, h2d_gbps=None, d2h_gbps=None,
                      memcpy_gbps=5.0, matmul_tflops={"fp32": 0.1, "tf32": 0.1}, adamw_gparams={"1": 1.0, "2": 1.2})
    for precision in ("fp32", "tf32"):
        cal.layers[layer_key(ModelConfig.from_name("tiny"), 2, 32, precision)] = LayerTiming(0.01, 0.005)
    cal.save()


# CI: the autos and the unclipped run (a train run each); slow: every auto given
@pytest.mark.parametrize("flags", [pytest.param(f, id=k, marks=[pytest.mark.slow] if k == "given" else [])
                                   for k, f in FLAG_SETS.items()])
def test_plan_json_is_the_plan_the_run_writes(ray_session: None, calibrated: None, tmp_path: Path, flags: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", "tiny", "--device", "cpu", "--batch-size", "2", "--seq-len", "32", *flags]
    assert main(["plan", *common, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["run_plan"]
    out = tmp_path / "run"
    assert main(["train", *common, "--steps", "1", "--out", str(out), "--checkpoint-every", "0",
                 "--no-save-final"]) == 0
    ran = json.loads((out / PLAN_FILE).read_text())
    assert planned == ran
    assert "auto" not in {str(v) for v in ran.values()} and ran["update"] in UPDATES
    if "--max-grad-norm" in flags:
        assert (ran["grads"], ran["update"]) == ("stream", "final")
    if "--resident" in flags:
        assert (ran["resident_units"], ran["kept_layers"], ran["tile_tokens"], ran["update"]) == (1, 1, None,
                                                                                               "speculative")


def test_plan_optimizer_workers_auto_reports_the_plan_a_run_makes(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --optimizer-workers auto` reports one decision, resolve's: on a calibrated GPU (the H100's, planned on
    this machine) the fastest predicted settings, which are the run_plan's too (what `train` runs)."""
    h100 = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrations" / "h100-80gb-hbm3.json"
    argv = ["plan", "--model", "7b", "--precision", "bf16", "--batch", "1", "--seq", "2048", "--micro-batches", "1",
            "--device", "cuda", "--gpu-gib", "78.66", "--host-gib", "123.68", "--calibration", str(h100),
            "--clip-rate", "1", "--compile", "on", "--optimizer-workers", "auto"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shown, run = out["plan"], out["run_plan"]
    assert (shown["optimizer_workers"], shown["grads"], shown["tile_tokens"]) == (
        run["optimizer_workers"], run["grads"], run["tile_tokens"])
    assert main(argv) == 0
    assert f"--optimizer-workers {run['optimizer_workers']} --grads {run['grads']}" in capsys.readouterr().out
