"""What `megatrain plan` and a run predict, and from which calibration: the flags that say how the run updates
(--speculate, --clip-rate, --compile) and where the calibration comes from (--calibration: a file, e.g. a GPU's
recorded one in benchmarks/calibrations/, so a plan made without that GPU predicts it; else this machine's cached one,
measured quickly where `plan --json` finds none; a run: its device's cached one), the predictor the plan splits the
GPU's spare memory by (megatrain/memory/on_device.py), and the prediction itself (megatrain/perf/predict.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from megatrain.config import COMPILE, LINK_GBPS, SPECULATE, ConfigError, EngineConfig, ModelConfig, compile_setting
from megatrain.memory.plan import MemoryPlan
from megatrain.perf.calibrate import Calibration, calibrate, device_name, layer_key
from megatrain.perf.compile_choice import auto_on_gpu
from megatrain.perf.predict import Prediction, predict

QUICK_CALIBRATION_S = 20.0


def add_prediction_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", type=Path, help="predict from this calibration file (any device's: e.g. "
                   "benchmarks/calibrations/h100-80gb-hbm3.json) instead of this machine's cached one")
    p.add_argument("--speculate", choices=SPECULATE, help="the update beside the backward, as train's (default auto)")
    p.add_argument("--clip-rate", type=float, default=0.0, help="share of steps assumed to clip (0 to 1, default 0): "
                   "a speculated step that clips rolls back, and speculate auto runs the next serially")
    p.add_argument("--compile", nargs="?", const="on", choices=COMPILE, help="as train's (auto: on a GPU where its "
                   "calibration timed compiled layers faster, or timed none)")


def plan_calibration(args: argparse.Namespace, on_gpu: bool, config: ModelConfig, cfg: Any) -> Calibration | None:
    """--calibration's file; else the cached calibration of the device the plan is for; with --json, where none is
    cached (or it lacks this model's layers), a quick one (~20 s), cached. None on a GPU plan made without a GPU here
    and no file given."""
    if args.calibration is not None:
        return Calibration.read(args.calibration)
    import torch

    if on_gpu and not torch.cuda.is_available():
        return None
    cal = run_calibration(on_gpu)
    key = layer_key(config, cfg.data.batch_size, cfg.data.seq_len, cfg.precision)
    if args.json and (cal is None or key not in cal.layers):
        device = "cuda" if on_gpu else "cpu"
        logging.getLogger("megatrain").info("calibrating %s for the prediction (megatrain calibrate does it once)",
                                            device_name(device))
        cal = calibrate(device, config, batch=cfg.data.batch_size, seq=cfg.data.seq_len, precision=cfg.precision,
                        max_seconds=QUICK_CALIBRATION_S, base=cal, time_compile=False)
        cal.save()
    return cal


def plan_prediction(args: argparse.Namespace, plan: MemoryPlan, config: ModelConfig, cal: Calibration | None,
                    cfg: Any, clipping: bool, workers: int, executors: int) -> Prediction | None:
    """The plan's predicted step; None without a calibration, or for a LoRA run (the model knows a whole model's
    optimizer and transfers, not a LoRA run's)."""
    if cal is None or cfg.lora:
        return None
    return predict(plan, config, cal, **_plan_settings(args, config, cal, cfg, clipping, workers, executors,
                                                       plan.on_gpu))


def _plan_settings(args: argparse.Namespace, config: ModelConfig, cal: Calibration, cfg: Any, clipping: bool,
                   workers: int, executors: int, on_gpu: bool) -> dict[str, Any]:
    return dict(precision=cfg.precision, optimizer_workers=workers, clipping=clipping, executors=executors,
                **prediction_flags(args, config, cal, cfg, on_gpu))


def prediction_flags(args: argparse.Namespace, config: ModelConfig, cal: Calibration, cfg: Any, on_gpu: bool
                     ) -> dict[str, Any]:
    """predict's keywords that `megatrain plan`'s flags give: how the run updates (--speculate, --clip-rate), whether
    its layers run compiled (--compile, as its executor decides), the nodes' link (--link-gbps)."""
    if not 0.0 <= args.clip_rate <= 1.0:
        raise ConfigError(f"--clip-rate is the share of steps that clip, from 0 to 1, got {args.clip_rate}.")
    return dict(link_gbps=args.link_gbps or LINK_GBPS, speculate=cfg.speculate, clip_rate=args.clip_rate,
                compiled=compiled_for(cfg.compile, on_gpu, cal, config, cfg.precision))


def compiled_for(setting: str | bool, on_gpu: bool, cal: Calibration, config: ModelConfig, precision: str) -> bool:
    """Whether the run's layers run compiled, as its executor decides (compile_choice.py), from `cal`: auto compiles
    on a GPU where `cal` timed this layer compiled faster, or timed none; the CPU path runs eager."""
    setting = compile_setting(setting)
    return setting == "on" or (setting == "auto" and on_gpu and auto_on_gpu(cal.device, cal, config, precision).on)


def run_calibration(on_gpu: bool) -> Calibration | None:
    """The cached calibration of a run's device (`megatrain calibrate`): what the Engine's plan splits the GPU's
    spare memory by and its progress line predicts from; None where none is cached or CUDA is not visible here (the
    driver asks for the GPU's name, and allocates nothing on it)."""
    import torch

    if on_gpu and not torch.cuda.is_available():
        return None
    return Calibration.load(device_name("cuda" if on_gpu else "cpu"))


def run_settings(config: ModelConfig, cal: Calibration, e: EngineConfig, clipping: bool, on_gpu: bool
                 ) -> dict[str, Any]:
    """predict's keywords for an Engine's run, from its EngineConfig (optimizer_workers and executors resolved): the
    update speculated as it speculates, compiled as its executor decides, no step assumed to clip."""
    return dict(precision=e.precision, optimizer_workers=int(e.optimizer_workers), clipping=clipping,
                executors=int(e.executors), speculate=e.speculate,
                compiled=compiled_for(e.compile, on_gpu, cal, config, e.precision))


def calibration_json(cal: Calibration | None, args: argparse.Namespace) -> dict[str, Any] | None:
    """Which calibration the prediction came from, for `plan --json`."""
    if cal is None:
        return None
    return {"device": cal.device, "created": cal.created, "source": cal.source,
            "path": None if args.calibration is None else str(args.calibration)}
