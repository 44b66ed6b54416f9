"""`megatrain train | finetune | plan | cleanup | report | doctor`.

Errors a user can fix (MegatrainError, also when raised inside an actor) print one line and exit 2;
Ctrl-C stops the run, removes its shared memory and exits 130.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from megatrain.config import GRAD_PLACEMENTS, PRESETS, SCHEDULES, MegatrainError, Terminated, cause_chain

GRADS_HELP = ("where gradients wait for the optimizer: auto (least host memory that works), arena (16 B/param on "
              "the host), stream (12 B/param, clipping off), device (12 B/param, on the GPU until the step ends)")


PRESETS_HELP = f"preset name ({', '.join(PRESETS)}) or HF directory"


def _add_train_flags(p: argparse.ArgumentParser, model_help: str = PRESETS_HELP) -> None:
    p.add_argument("--config", help="TOML config (top-level keys plus a [data] table); flags override it")
    p.add_argument("--model", help=model_help)
    p.add_argument("--steps", type=int)
    p.add_argument("--out", dest="out_dir", help="run directory (checkpoints, logs, final model)")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--max-grad-norm", type=float, help="0 turns clipping off")
    p.add_argument("--optimizer-workers", type=int)
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--device", help="auto | cpu | cuda | cpu-async[:SEED] (the CPU with a GPU's streams simulated)")
    p.add_argument("--grads", choices=GRAD_PLACEMENTS, help=GRADS_HELP)
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the decoder layer (faster steps on a GPU after minutes of compiling)")
    p.add_argument("--batch-size", dest="data.batch_size", type=int)
    p.add_argument("--seq-len", dest="data.seq_len", type=int)
    p.add_argument("--micro-batches", type=int, help="a step is this many micro-batches of --batch-size rows and "
                                                       "one update (weights stream once per step)")
    p.add_argument("--executors", type=_auto_none_or(int), help="executors, data parallel over each step's rows "
                   "(auto: one per GPU of the node, one on the CPU path)")
    p.add_argument("--schedule", choices=("auto", *SCHEDULES), help="layer-major: the weights cross once a step, "
                   "every micro-batch's activations kept; per-micro-batch: once per micro-batch (auto: the first "
                   "that fits)")
    _add_long_context_flags(p)
    p.add_argument("--document-positions", dest="data.document_positions", action="store_true", default=None,
                   help="packed rows carry per-document position_ids: each document attends within itself only")
    p.add_argument("--tokenizer", dest="data.tokenizer", help="byte, or a directory/tokenizer.json")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (0: none)")
    p.add_argument("--no-save-final", dest="save_final", action="store_false", default=None,
                   help="do not write the final HF model (final/)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--log-every", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", default=None, help="continue from the newest good checkpoint")
    p.add_argument("--address", help="the Ray cluster: 'auto' the one `ray start --head` runs here, host:port "
                                      "another, 'local' a private Ray for this run (default: the `ray start` "
                                      "cluster if it answers, else a private one)")
    p.add_argument("--trace", action="store_true", default=None, help="write a Chrome/Perfetto trace of the run")


def _auto_none_or(kind: type) -> Any:
    def parse(text: str) -> Any:
        lowered = text.lower()
        return None if lowered == "none" else "auto" if lowered == "auto" else kind(text)
    parse.__name__ = kind.__name__  # what argparse names in its "invalid value" message
    return parse


def _add_long_context_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tile-tokens", type=_auto_none_or(int),
                   help="tokens per tile of the layers' token-wise work: auto (the plan picks), none, or N")
    p.add_argument("--checkpoint-budget-gib", type=_auto_none_or(float),
                   help="GiB of GPU memory for layer checkpoints, the rest in host memory: auto (the plan picks), "
                        "none (all on the GPU), or N (0: all in host memory)")


def _overrides(args: argparse.Namespace, skip: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in skip and v is not None}


def cmd_train(args: argparse.Namespace) -> int:
    from pipelines.train import TrainConfig, run

    overrides = _overrides(args, ("command", "config", "func", "verbose", "data_path"))
    if args.data_path:
        overrides["data.source"] = args.data_path
    summary = run(TrainConfig.load(args.config, overrides))
    _print_summary(summary)
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from pipelines.finetune import finetune

    summary = finetune(args.model, args.data_path, args.out_dir, config=args.config,
                       overrides=_overrides(args, ("command", "config", "func", "verbose", "model", "data_path",
                                                   "out_dir")))
    _print_summary(summary)
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    first, last = summary.get("first_loss"), summary.get("last_loss")
    if first is not None:
        start, steps = summary.get("start", 0), summary["steps"]
        done = f"{steps} steps" if not start else f"steps {start + 1}-{steps} (resumed after step {start})"
        print(f"trained {done}: loss {first:.4f} -> {last:.4f}"
              + (f", {summary['skipped_steps']} skipped" if summary.get("skipped_steps") else ""))
    for step, loss in summary.get("evals", []):
        print(f"  eval loss at step {step}: {loss:.4f}")
    if summary.get("final"):
        print(f"model written to {summary['final']} (loads with transformers)")


def cmd_plan(args: argparse.Namespace) -> int:
    """The plan of the run `megatrain train` would make with the same config file and flags."""
    from megatrain.config import ConfigError, EngineConfig, OptimConfig
    from megatrain.memory.plan import gpu_free_here, longest_seq, plan_run
    from megatrain.memory.store import resolve_model
    from pipelines.train import TrainConfig

    cfg = TrainConfig.load(args.config, {"model": args.model, "data.batch_size": args.batch, "data.seq_len": args.seq,
                                         "precision": args.precision, "optimizer_workers": args.optimizer_workers,
                                         "device": args.device, "grads": args.grads,
                                         "max_grad_norm": args.max_grad_norm, "tile_tokens": args.tile_tokens,
                                         "checkpoint_budget_gib": args.checkpoint_budget_gib,
                                         "micro_batches": args.micro_batches, "schedule": args.schedule})
    # the checks the Engine would make at its start
    EngineConfig(device=cfg.device, precision=cfg.precision, optimizer_workers=cfg.optimizer_workers, grads=cfg.grads,
                 tile_tokens=cfg.tile_tokens, checkpoint_budget_gib=cfg.checkpoint_budget_gib)
    optim = OptimConfig(max_grad_norm=cfg.max_grad_norm)
    for flag, value in (("--gpu-gib", args.gpu_gib), ("--host-gib", args.host_gib)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be a positive number of GiB, got {value}.")
    config, _, name = resolve_model(cfg.model)
    on_gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and _cuda())
    gpu_free = int(args.gpu_gib * 2**30) if args.gpu_gib else (gpu_free_here() if on_gpu else None)
    budget = cfg.checkpoint_budget_gib
    common = dict(name=name, precision=cfg.precision, optimizer_workers=cfg.optimizer_workers, on_gpu=on_gpu,
                  gpu_free=gpu_free, micro_batches=cfg.micro_batches,
                  host_free=None if args.host_gib is None else int(args.host_gib * 2**30))
    long_context = dict(tile_tokens=cfg.tile_tokens,
                        checkpoint_budget=budget if budget in ("auto", None) else round(budget * 2**30))
    plan = plan_run(config, cfg.data.batch_size, cfg.data.seq_len, grads=cfg.grads, clipping=optim.clipping,
                    schedule=cfg.schedule, **long_context, **common)
    print(plan.report())
    longest = plan.longest_seq
    if longest is None:  # it fits: how far it would
        longest = longest_seq(config, cfg.data.batch_size, grads=plan.grads, **long_context,
                              **{**common, "schedule": plan.schedule})
    where = "the GPU and host given" if args.gpu_gib or args.host_gib else "this machine"
    if on_gpu and gpu_free is None:
        where += " (GPU memory unknown: give --gpu-gib)"
    print(f"longest sequence at batch {cfg.data.batch_size} on {where}: {longest} tokens"
          + (f" (the model has {config.max_position_embeddings} positions)"
             if longest > config.max_position_embeddings else ""))
    return 0 if (plan.host_problem() or plan.gpu_problem()) is None else 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_cleanup(args: argparse.Namespace) -> int:
    from megatrain.memory.arena import list_segments, remove_stale_segments
    from pipelines.engine import reap_orphaned_ray_agents

    logging.disable(logging.INFO)  # what the cleanup functions log, this command prints itself
    try:
        removed = remove_stale_segments(everything=args.all)
        reaped = reap_orphaned_ray_agents()
    finally:
        logging.disable(logging.NOTSET)
    for path in removed:
        print(f"removed {path}")
    for pid in reaped:
        print(f"stopped orphaned Ray agent process {pid}")
    left = list_segments()
    print(f"removed {len(removed)} segment(s); {len(left)} belong to running processes"
          + (" (use --all to remove them too)" if left else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from megatrain.telemetry import main_report

    return main_report(args.run_dir, args.step)


def cmd_doctor(args: argparse.Namespace) -> int:
    from megatrain.doctor import main as main_doctor

    return main_doctor(args.address, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="pretrain (default: tiny model on synthetic data)")
    _add_train_flags(p)
    p.add_argument("--data", dest="data_path", help="text/jsonl/parquet/arrow file or folder (default synthetic)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("finetune", help="supervised fine-tuning of an HF checkpoint on chat/text data")
    _add_train_flags(p, model_help="HF model directory (config.json + safetensors weights) to fine-tune")
    p.add_argument("--data", dest="data_path", required=True)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("plan", help="memory needed per tier, and whether it fits here (defaults: train's)")
    p.add_argument("--config", help="the TOML config of a train run; flags override it")
    p.add_argument("--model", help=PRESETS_HELP)
    p.add_argument("--batch", "--batch-size", dest="batch", type=int)
    p.add_argument("--seq", "--seq-len", dest="seq", type=int)
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--optimizer-workers", type=int)
    p.add_argument("--device", help="auto | cpu | cuda | cpu-async[:SEED] (the CPU with a GPU's streams simulated)")
    p.add_argument("--gpu-gib", type=float, help="GPU memory to plan for (default: what the GPU here has free)")
    p.add_argument("--micro-batches", type=int, help="micro-batches of --batch rows per step")
    p.add_argument("--schedule", choices=("auto", *SCHEDULES))
    p.add_argument("--host-gib", type=float, help="host memory to plan for, /dev/shm included (default: what this "
                                                   "machine has available)")
    _add_long_context_flags(p)
    p.add_argument("--grads", choices=GRAD_PLACEMENTS, help=GRADS_HELP)
    p.add_argument("--max-grad-norm", type=float, help="0: clipping off (lets gradients stream)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("cleanup", help="remove shared-memory segments of runs whose process is gone")
    p.add_argument("--all", action="store_true", help="also remove segments of live runs")
    p.set_defaults(func=cmd_cleanup)

    p = sub.add_parser("report", help="stall table per step and a PNG timeline of a run")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("doctor", help="check this machine: GPU, /dev/shm, page-locking, PCIe, optimizer, Ray, a step")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--address", help="the Ray cluster to report on ('auto': the one `ray start` runs here)")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(f"\n{'terminated' if terminated else 'interrupted'}: shared memory released", file=sys.stderr)
        return 143 if terminated else 130
    except Exception as e:  # noqa: BLE001 - turned into one sentence unless --verbose
        cause = cause_chain(e)[-1]  # Ray's wrapper is also the wrapped class, with a traceback for a message
        if isinstance(cause, MegatrainError) and not args.verbose:
            print(f"megatrain: error: {cause}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
