"""What `megatrain plan` predicts, and from which calibration: the flags that say how the run updates (--speculate,
--clip-rate, --compile) and where the calibration comes from (--calibration: a file, e.g. a GPU's recorded one in
benchmarks/calibrations/, so a plan made without that GPU predicts it; else this machine's cached one, measured quickly
where `plan --json` finds none), and the prediction itself (megatrain/perf/predict.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from megatrain.config import COMPILE, LINK_GBPS, SPECULATE, ConfigError, ModelConfig
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
    device = "cuda" if on_gpu else "cpu"
    name = device_name(device)
    cal = Calibration.load(name)
    key = layer_key(config, cfg.data.batch_size, cfg.data.seq_len, cfg.precision)
    if args.json and (cal is None or key not in cal.layers):
        logging.getLogger("megatrain").info("calibrating %s for the prediction (megatrain calibrate does it once)",
                                            name)
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
    if not 0.0 <= args.clip_rate <= 1.0:
        raise ConfigError(f"--clip-rate is the share of steps that clip, from 0 to 1, got {args.clip_rate}.")
    setting = cfg.compile  # compile = auto decides as the executor would, from this calibration (compile_choice.py)
    compiled = setting == "on" or (setting == "auto" and plan.on_gpu and auto_on_gpu(cal.device, cal, config,
                                                                                       cfg.precision).on)
    return predict(plan, config, cal, precision=cfg.precision, optimizer_workers=workers, clipping=clipping,
                   executors=executors, link_gbps=args.link_gbps or LINK_GBPS, speculate=cfg.speculate,
                   clip_rate=args.clip_rate, compiled=compiled)


def calibration_json(cal: Calibration | None, args: argparse.Namespace) -> dict[str, Any] | None:
    """Which calibration the prediction came from, for `plan --json`."""
    if cal is None:
        return None
    return {"device": cal.device, "created": cal.created, "source": cal.source,
            "path": None if args.calibration is None else str(args.calibration)}
