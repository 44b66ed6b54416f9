"""`megatrain train | finetune | plan | calibrate | generate | dpo | grpo | cleanup | report | doctor | dashboard`.

Errors a user can fix (MegatrainError, also when raised inside an actor) print one line and exit 2;
Ctrl-C stops the run, removes its shared memory and exits 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from megatrain.config import (
    BF16_COPY,
    COMPILE,
    GRAD_PLACEMENTS,
    LINK_GBPS,
    PRESETS,
    RESIDENT_HELP,
    RESIDENT_WEIGHTS,
    SCHEDULES,
    SPECULATE,
    MegatrainError,
    Terminated,
    cause_chain,
)
from pipelines.generate_command import add_generate_parser
from pipelines.nvme_cli import add_nvme_flags
from pipelines.plan_cli import _plan_json  # noqa: F401 - where tests and callers have found it
from pipelines.plan_prediction import add_prediction_flags
from pipelines.post_commands import add_post_parsers

GRADS_HELP = ("where gradients wait for the optimizer: auto (least host memory that works), arena (16 B/param on "
              "the host), stream (12 B/param, clipping off), device (12 B/param, on the GPU until the step ends)")


PRESETS_HELP = f"preset name ({', '.join(PRESETS)}), HF directory or Hugging Face Hub name (org/name[@revision])"


def _add_train_flags(p: argparse.ArgumentParser, model_help: str = PRESETS_HELP) -> None:
    p.add_argument("--config", help="TOML config (top-level keys plus a [data] table); flags override it")
    p.add_argument("--model", help=model_help)
    p.add_argument("--steps", type=int)
    p.add_argument("--out", dest="out_dir", help="run directory (checkpoints, logs, final model)")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--max-grad-norm", type=float, help="0 turns clipping off")
    p.add_argument("--optimizer-workers", type=_int_or_auto,
                   help="N per node, or auto: one per free CPU of the node (the fastest calibrated count, if cached)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--device", help="auto | cpu | cuda | cpu-async[:SEED] (the CPU with a GPU's streams simulated)")
    p.add_argument("--grads", choices=GRAD_PLACEMENTS, help=GRADS_HELP)
    p.add_argument("--speculate", choices=SPECULATE,
                   help="update each unit as its gradient lands and settle it once the clip is known (auto: "
                        "not after a step that clipped; off: the update waits for the whole backward)")
    p.add_argument("--compile", nargs="?", const="on", choices=COMPILE,
                   help="torch.compile the layers and the head: auto (default: on a GPU where the calibration measured "
                        "it faster, or nothing was measured; off on the CPU path), on (the flag alone), off")
    _add_on_device_flags(p)
    _add_lora_flags(p)
    p.add_argument("--adapter", help="a PEFT adapter directory to start the LoRA run from (its settings unless --lora)")
    p.add_argument("--merge", action="store_true", default=None,
                   help="LoRA: besides the adapter in OUT/final, write the base with it merged in to OUT/merged")
    p.add_argument("--batch-size", dest="data.batch_size", type=int)
    p.add_argument("--seq-len", dest="data.seq_len", type=int)
    p.add_argument("--micro-batches", type=_auto_none_or(int),
                   help="a step is this many micro-batches of --batch-size rows and one update (weights stream once "
                        "per step); auto: --batch-size is the step's rows, in the fewest micro-batches that fit")
    p.add_argument("--executors", type=_auto_none_or(int), help="executors, data parallel over each step's rows "
                   "(auto: one per GPU of the node, one on the CPU path)")
    p.add_argument("--nodes", type=int, help="Ray nodes the run spans (the driver's first), each with its parameter "
                   "store, optimizer workers and executors; gradients and weights cross between them over TCP")
    p.add_argument("--schedule", choices=("auto", *SCHEDULES), help="layer-major: the weights cross once a step, "
                   "every micro-batch's activations kept; per-micro-batch: once per micro-batch (auto: the first "
                   "that fits)")
    _add_long_context_flags(p)
    p.add_argument("--document-positions", dest="data.document_positions", action="store_true", default=None,
                   help="packed rows carry per-document position_ids: each document attends within itself only")
    p.add_argument("--tokenizer", dest="data.tokenizer", help="byte, or a directory/tokenizer.json")
    for flag, what in (("split", "its split (default train)"), ("subset", "the configuration"),
                       ("column", "the documents' column (default: detected)"), ("streaming", "stream it")):
        p.add_argument(f"--{flag}", dest=f"data.{flag}", help=f"a datasets source (Hub name, save_to_disk): {what}",
                       **({"action": argparse.BooleanOptionalAction, "default": None} if flag == "streaming" else {}))
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


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", nargs="?", const="defaults", help="LoRA adapters on the frozen base: --lora alone (r=16, "
                   "alpha=2r, all-linear) or r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05,rslora=true]")
    p.add_argument("--lora-base-dtype", choices=("bf16", "fp32"), help="LoRA: the frozen base's precision on the "
                                                                       "host (default bf16: 2 B/param)")


def _add_on_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resident", type=_word_or_count("auto", "none"), help=RESIDENT_HELP + "; auto: as many as the GPU "
                   "has room for, the embedding and the first layers, none on the CPU path")
    p.add_argument("--resident-weights", choices=RESIDENT_WEIGHTS,
                   help="bf16: the resident units' bf16 weights for compute are a copy on the GPU (copy, 2 B a "
                        "parameter) or cast from their fp32 weights at each use (cast: more units fit); auto: the "
                        "faster predicted where this GPU is calibrated, else copy")
    p.add_argument("--gpu-memory-gib", "--gpu-memory", dest="gpu_memory_gib", type=float, metavar="GIB",
                   help="hold the run's GPU to this many GiB: the plan fits in it and the executor's allocator is "
                        "capped at it (e.g. 10: an RTX 3080's memory on a larger GPU)")
    p.add_argument("--bf16-copy", choices=BF16_COPY,
                   help="bf16: a bf16 copy of the weights in the host arena (keep: 2 B a parameter, half the PCIe "
                        "bytes) or none (fp32 weights cast on the GPU); auto: kept only where the step predicted "
                        "without it is longer on this GPU's calibration, else where the host has room")
    p.add_argument("--keep-activations", type=_word_or_count("auto", "none", "all"),
                   help="auto | none | all | N: the top N decoder layers keep their activations for the backward "
                        "instead of recomputing (megatrain/memory/kept_activations.py); auto: as many as the GPU has "
                        "room for after the resident units, none on the CPU path")


def _word_or_count(*words: str) -> Any:
    def parse(text: str) -> int | str:
        lowered = text.lower()
        return lowered if lowered in words else int(text)
    parse.__name__ = "int"  # what argparse names in its "invalid value" message
    return parse


def _auto_none_or(kind: type) -> Any:
    def parse(text: str) -> Any:  # "none" stays a word: None is a flag not given (TrainConfig.load)
        lowered = text.lower()
        return lowered if lowered in ("auto", "none") else kind(text)
    parse.__name__ = kind.__name__  # what argparse names in its "invalid value" message
    return parse


def _int_or_auto(text: str) -> int | str:
    return "auto" if text.lower() == "auto" else int(text)


_int_or_auto.__name__ = "int"  # what argparse names in its "invalid value" message


def _add_long_context_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tile-tokens", type=_auto_none_or(int),
                   help="tokens per tile of the layers' token-wise work: auto (the plan picks), none, or N")
    p.add_argument("--checkpoint-budget-gib", type=_auto_none_or(float),
                   help="GiB of GPU memory for activation checkpoints, the rest in host memory: auto (the plan picks), "
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
        what = "LoRA adapter" if summary.get("lora") else "model"
        print(f"{what} written to {summary['final']} (loads with {'peft' if summary.get('lora') else 'transformers'})")
    if summary.get("merged"):
        print(f"merged model written to {summary['merged']} (loads with transformers)")


def cmd_plan(args: argparse.Namespace) -> int:
    """The plan of the run `megatrain train` would make with the same config file and flags (pipelines/plan_cli.py)."""
    from pipelines.plan_cli import cmd_plan as plan

    return plan(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measures this machine for predicted step times and caches it (megatrain/perf/calibrate.py)."""
    from dataclasses import replace

    from megatrain.perf.calibrate import Calibration, calibrate, device_name
    from megatrain.store import resolve_model
    from pipelines.train import TrainConfig

    device = args.device or ("cuda" if _cuda() else "cpu")
    # without --model: the layers of the run `megatrain train` makes by default, so its progress line predicts
    default = TrainConfig()
    config = resolve_model(args.model or default.model, verify=False)[0]  # timings only
    batch = args.batch or (8 if args.model else default.data.batch_size)
    seq = args.seq or (2048 if args.model else default.data.seq_len)
    base = Calibration.load(device_name(device))
    cal = calibrate(device, config, batch=batch, seq=seq, precision=args.precision,
                    max_seconds=args.max_seconds, base=base, time_compile=args.compiled)
    if args.step_costs:
        from pipelines.step_costs import measure_step_costs

        costs = measure_step_costs(cal)
        cal = replace(cal, step_fixed_s=costs.step_fixed_s, unit_message_s=costs.unit_message_s)
    path = cal.save()
    if args.json:
        from dataclasses import asdict

        print(json.dumps({**asdict(cal), "path": str(path)}, indent=2))
        return 0
    copies = ("no host <-> device copies (the CPU path)" if cal.h2d_gbps is None
              else f"H2D {cal.h2d_gbps:.1f} GB/s, D2H {cal.d2h_gbps:.1f} GB/s (registered arena)")
    print(f"calibrated {cal.device} ({cal.cores} cores, {cal.compute_threads} compute threads): {copies}, host "
          f"memcpy {cal.memcpy_gbps:.1f} GB/s")
    print("matmul TFLOP/s: " + ", ".join(f"{p} {r:.3g}" for p, r in cal.matmul_tflops.items()))
    for what, rates in (("alone", cal.adamw_gparams), (f"beside {cal.copies_kind} at {cal.copies_gbps or 0:.1f} GB/s",
                         cal.adamw_beside_copies_gparams), ("its rollback pass, beside them", cal.rollback_gparams)):
        print(f"optimizer pool G params/s by workers, {what}: " + ", ".join(f"{w}: {r:.2f}" for w, r in rates.items()))
    for key, timing in cal.layers.items():
        print(f"layers {key}: {1e3 * timing.layer_s:.1f} ms a layer, {1e3 * timing.rest_s:.1f} ms the rest")
    for key, c in cal.compiled.items():
        print(f"compiled {key}: {1e3 * c.compiled_layer_s:.1f} ms a layer (eager {1e3 * c.eager_layer_s:.1f}), "
              f"{1e3 * c.compiled_rest_s:.1f} ms the rest (eager {1e3 * c.eager_rest_s:.1f}), {c.compile_s:.0f} s "
              "compiling")
    if cal.step_fixed_s is not None:
        print(f"a step's fixed costs through Ray: {1e3 * cal.step_fixed_s:.1f} ms a step, "
              f"{1e3 * cal.unit_message_s:.2f} ms a unit message to an optimizer worker")
    print(f"cached in {path}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_cleanup(args: argparse.Namespace) -> int:
    from megatrain.memory.arena import list_segments, remove_stale_segments
    from pipelines.cluster import reap_orphaned_ray_agents

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
    from megatrain.telemetry.report import main_report

    return main_report(args.run_dir, args.step)


def cmd_doctor(args: argparse.Namespace) -> int:
    from pipelines.doctor import main as main_doctor

    return main_doctor(args.address, args.json, args.nvme)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatrain.telemetry.dashboard import dashboard_json, write_dashboard

    if args.out is None:
        print(dashboard_json(), end="")
    else:
        print(f"wrote {write_dashboard(Path(args.out))} (Grafana: Dashboards > New > Import, on a Prometheus "
              "datasource that scrapes Ray)")
    return 0


def _add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="memory needed per tier, and whether it fits here (defaults: train's)")
    p.add_argument("--config", help="the TOML config of a train run; flags override it")
    p.add_argument("--model", help=PRESETS_HELP)
    p.add_argument("--batch", "--batch-size", dest="batch", type=int)
    p.add_argument("--seq", "--seq-len", dest="seq", type=int)
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--optimizer-workers", type=_int_or_auto, help="N, or auto: the fastest predicted settings "
                                                                    "among those left auto (needs a calibration)")
    p.add_argument("--device", help="auto | cpu | cuda | cpu-async[:SEED] (the CPU with a GPU's streams simulated)")
    p.add_argument("--gpu-gib", type=float, help="GPU memory to plan for (default: what the GPU here has free)")
    p.add_argument("--micro-batches", type=_auto_none_or(int),
                   help="micro-batches of --batch rows per step (auto: --batch is the step's rows)")
    p.add_argument("--schedule", choices=("auto", *SCHEDULES))
    p.add_argument("--host-gib", type=float, help="host memory to plan for, /dev/shm included (default: what this "
                                                   "machine has available)")
    _add_long_context_flags(p)
    p.add_argument("--grads", choices=GRAD_PLACEMENTS, help=GRADS_HELP)
    _add_on_device_flags(p)
    _add_lora_flags(p)
    p.add_argument("--max-grad-norm", type=float, help="0: clipping off (lets gradients stream)")
    p.add_argument("--executors", type=int, help="executors per node, each computing --batch rows (default 1)")
    p.add_argument("--nodes", type=int, help="hosts the run spans: per-node memory (1/nodes of the Adam moments) "
                   "and the network bytes and time per step")
    p.add_argument("--link-gbps", type=float, help=f"GB/s between hosts for the prediction (default {LINK_GBPS:g}, "
                   "100 Gb Ethernet)")
    p.add_argument("--json", action="store_true", help="the plan and its predicted step time as JSON (calibrates "
                                                       "this machine first where no calibration is cached)")
    add_prediction_flags(p)
    p.add_argument("--post", choices=("dpo", "grpo"), help="also what post-training adds: the policy step, the "
                   "reference log-probs, GRPO's rollout KV cache (--batch rows of --seq tokens)")
    p.add_argument("--pairs", type=int, default=0, help="--post dpo: the data's pairs (their reference log-probs)")
    p.add_argument("--kl", action="store_true", help="--post grpo: the KL term's copy of the initial weights")
    p.set_defaults(func=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="pretrain (default: tiny model on synthetic data)")
    _add_train_flags(p)
    p.add_argument("--data", dest="data_path", help="data file or folder, save_to_disk directory or Hub data set")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("finetune", help="supervised fine-tuning of an HF checkpoint on chat/text data")
    _add_train_flags(p, model_help="HF model directory (config.json + safetensors weights) to fine-tune")
    p.add_argument("--data", dest="data_path", required=True)
    p.set_defaults(func=cmd_finetune)

    _add_plan_parser(sub)

    p = sub.add_parser("calibrate", help="measure this machine (copies, matmul, AdamW, a model's layers) for "
                                         "predicted step times; cached for `megatrain plan`")
    p.add_argument("--device", help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--model", help=PRESETS_HELP + ": also time its layers at --batch x --seq tokens (default: the "
                   "tiny preset at 8 x 256, the layers of megatrain train's default run)")
    p.add_argument("--batch", type=int, help="rows (default 8)")
    p.add_argument("--seq", type=int, help="tokens a row (default 2048 with --model, else 256)")
    p.add_argument("--step-costs", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure a step's fixed costs through Ray (a private Ray, ~20 s; default on)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="tf32")
    p.add_argument("--max-seconds", type=float, default=60.0, help="about how long to measure (default 60)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, with --model, also time its layers compiled, for compile auto (a minute or more "
                        "of compiling beyond --max-seconds; default on)")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")
    p.set_defaults(func=cmd_calibrate)

    add_generate_parser(sub)
    add_post_parsers(sub)

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

    p = sub.add_parser("dashboard", help="megatrain's Grafana dashboard as JSON (stalls by cause, throughput, "
                                         "optimizer, transfers); runs on a `ray start` cluster leave it beside Ray's")
    p.add_argument("--out", help="file to write (default: print it)")
    p.set_defaults(func=cmd_dashboard)
    add_nvme_flags(sub)  # the NVMe tier's, on train, finetune, plan, calibrate, doctor and cleanup
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
