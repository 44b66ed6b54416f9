"""`megatrain plan`: the RunPlan of the run `megatrain train` would make with the same config file and flags, made by
the same resolve (pipelines/run_plan.py) for this machine (or the GPU and host the flags give), its memory report,
the longest sequence that fits, and the predicted step. With --optimizer-workers auto it says what resolve decided (on a
calibrated GPU: the fastest predicted settings among those left auto, megatrain/perf/predict.py: choose)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from megatrain.config import ConfigError, EngineConfig, OptimConfig
from megatrain.memory.post_plan import post_plan
from megatrain.run_plan import Machine, Request, RunPlan

PLAN_FLAGS = {"model": "model", "data.batch_size": "batch", "data.seq_len": "seq", "precision": "precision",
              "optimizer_workers": "optimizer_workers", "device": "device", "grads": "grads",
              "max_grad_norm": "max_grad_norm", "tile_tokens": "tile_tokens",
              "checkpoint_budget_gib": "checkpoint_budget_gib", "micro_batches": "micro_batches",
              "schedule": "schedule", "nodes": "nodes", "executors": "executors", "resident": "resident",
              "lora": "lora", "keep_activations": "keep_activations", "resident_weights": "resident_weights",
              "lora_base_dtype": "lora_base_dtype", "speculate": "speculate", "compile": "compile", "nvme": "nvme",
              "nvme_states": "nvme_states", "bf16_copy": "bf16_copy",
              "gpu_memory_gib": "gpu_memory_gib"}


def plan_request(args: argparse.Namespace) -> tuple[Any, Request]:
    """(the TrainConfig, the Request) of the train run with this config file and these flags."""
    from megatrain.store import resolve_model
    from pipelines.train import TrainConfig, engine_kwargs, with_size_defaults

    cfg = TrainConfig.load(args.config, {key: getattr(args, flag) for key, flag in PLAN_FLAGS.items()})
    for flag, value, unit in (("--gpu-gib", args.gpu_gib, "GiB"), ("--host-gib", args.host_gib, "GiB"),
                              ("--link-gbps", args.link_gbps, "GB/s")):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be a positive number of {unit}, got {value}.")
    if not 0.0 <= args.clip_rate <= 1.0:
        raise ConfigError(f"--clip-rate is the share of steps that clip, from 0 to 1, got {args.clip_rate}.")
    config, _, name = resolve_model(cfg.model, verify=False)  # a plan runs nothing: no self-check
    kwargs = engine_kwargs(with_size_defaults(cfg, config))
    engine = EngineConfig(**{k: kwargs[k] for k in EngineConfig.__dataclass_fields__ if k in kwargs and k != "lora"})
    optim = OptimConfig(**{k: kwargs[k] for k in OptimConfig.__dataclass_fields__ if k in kwargs})
    return cfg, Request(config, name, engine, optim, cfg.data.batch_size, cfg.data.seq_len, cfg.lora, cfg.adapter,
                        args.clip_rate)


def plan_machine(args: argparse.Namespace, request: Request, cfg: Any) -> Machine:
    """This machine as a run would find it (a private Ray cluster of its CPUs), or the GPU and host the flags give
    (and the cores of the machine --calibration measured)."""
    import torch

    from megatrain.memory.plan import gpu_free_here
    from megatrain.perf.calibrate import device_name
    from pipelines.nvme_cli import nvme_rates
    from pipelines.plan_prediction import plan_calibration

    cuda = torch.cuda.is_available()
    device = request.engine.device
    on_gpu = device.startswith("cuda") or (device == "auto" and cuda)
    cal = plan_calibration(args, on_gpu, request.config, cfg)
    gpu_free = int(args.gpu_gib * 2**30) if args.gpu_gib else (gpu_free_here() if on_gpu else None)
    gpu_name = cal.device if cal is not None else device_name("cuda") if cuda else "the GPU"
    cores = (cal.cores if cal is not None else None) or os.cpu_count() or 1  # the calibrated machine's, if given
    return Machine(has_gpu=device.startswith("cuda") or cuda, gpus=torch.cuda.device_count() if cuda else 1,
                   free_cpus=float(cores), nodes=request.engine.nodes, gpu_free=gpu_free,
                   host_free=None if args.host_gib is None else int(args.host_gib * 2**30), calibration=cal,
                   gpu_name=gpu_name, link_gbps=args.link_gbps, nvme_gbps=nvme_rates(args))


def longest(request: Request, machine: Machine, run: RunPlan) -> int:
    """The longest sequence that fits at the run's batch (the plan's own, where it does not fit)."""
    from megatrain.memory.plan import longest_seq
    from megatrain.memory.tier_plan import with_tier

    plan, e, tier = run.memory, request.engine, run.memory.tier
    if plan.longest_seq is not None and tier is None:  # plan_run's search knows no tier
        return plan.longest_seq
    budget = e.checkpoint_budget_gib
    def placed(p: Any) -> Any:  # the run's tier at each length: the states it holds are not the host's
        return p if tier is None else with_tier(p, request.config, tier.directory, tier.names,
                                                (tier.read_gbps, tier.write_gbps))

    return longest_seq(request.config, run.batch, grads=plan.grads, tile_tokens=e.tile_tokens, placed=placed,
                       checkpoint_budget=budget if budget in ("auto", None) else round(budget * 2**30),
                       name=run.model, precision=run.precision, optimizer_workers=run.optimizer_workers,
                       on_gpu=run.on_gpu, gpu_free=machine.gpu_free, micro_batches=run.micro_batches,
                       nodes=run.nodes, executors=run.executors, host_free=machine.host_free,
                       schedule=plan.schedule, lora=run.lora, lora_base_dtype=run.lora_base_dtype)


def cmd_plan(args: argparse.Namespace) -> int:
    """The plan of the run `megatrain train` would make with the same config file and flags."""
    from pipelines.plan_prediction import calibration_json, plan_prediction
    from pipelines.run_plan import resolve

    cfg, request = plan_request(args)
    machine = plan_machine(args, request, cfg)
    run = resolve(request, machine)
    plan, cal = run.memory, machine.calibration
    prediction = plan_prediction(args, plan, request.config, cal, cfg, run.clipping, run.optimizer_workers,
                                 run.executors)
    fits = (plan.host_problem() or plan.gpu_problem()) is None
    most = longest(request, machine, run)
    if args.json:
        out = _plan_json(plan, prediction, cal, most, fits, run.optimizer_workers)
        # run_plan: what `megatrain train` with these flags runs, as its OUT/plan.json
        print(json.dumps({**out, "calibration": calibration_json(cal, args), "run_plan": run.to_dict()}, indent=2))
        return 0 if fits else 1
    print(plan.report())
    if request.engine.micro_batches == "auto":
        print(f"micro-batches auto: {plan.micro_batches} of {plan.batch} rows")
    where = "the GPU and host given" if args.gpu_gib or args.host_gib else "this machine"
    if run.on_gpu and machine.gpu_free is None:
        where += " (GPU memory unknown: give --gpu-gib)"
    positions = request.config.max_position_embeddings
    print(f"longest sequence at batch {plan.batch} on {where}: {most} tokens"
          + (f" (the model has {positions} positions)" if most > positions else ""))
    if args.optimizer_workers == "auto":  # what resolve decided, and how (the search's pick where it searched)
        decided = next(note for note in run.notes if note.startswith("optimizer_workers auto"))
        tiles = "none" if plan.tile_tokens is None else plan.tile_tokens
        print(f"{decided} (--optimizer-workers {run.optimizer_workers} --grads {plan.grads} --tile-tokens {tiles})")
    if prediction is not None:
        print(prediction.report())
    if plan.tier is not None:  # its bytes, the disk's traffic per step and the step with the disk as a bound
        print("\n".join(plan.tier.report(*((prediction.step_s, prediction.beside_update_s())
                                            if prediction is not None else ()))))
    if args.post:  # what DPO's or GRPO's modes add (megatrain/memory/post_plan.py)
        print(post_plan(request.config, args.post, plan.batch, plan.seq, request.engine.precision, args.pairs,
                        args.kl, plan).report())
    return 0 if fits else 1


def _plan_json(plan: Any, prediction: Any, cal: Any, longest: int, fits: bool, workers: int) -> dict[str, Any]:
    from dataclasses import asdict

    out: dict[str, Any] = {"predicted_step_s": None, "predicted_tokens_per_s": None, "bound": None}
    if prediction is not None:
        out.update(prediction.to_dict())
        if plan.tier is not None:  # the step with the disk as a bound, as the report prints it
            out["beside_update_s"] = prediction.beside_update_s()
            out["predicted_with_disk_s"] = plan.tier.bound_s(prediction.step_s, out["beside_update_s"])
    out["plan"] = {**asdict(plan), "kept_note": plan.kept.describe(), "step_tokens": plan.step_tokens,
                   "host_total": plan.host_total,
                   "gpu_total": plan.gpu_total, "optimizer_workers": workers, "longest_seq": longest}
    out["fits"] = fits
    out["problem"] = plan.host_problem() or plan.gpu_problem()
    out["calibration"] = None if cal is None else {"device": cal.device, "created": cal.created}
    return out
