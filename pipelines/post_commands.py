"""`megatrain dpo` and `megatrain grpo`: post-training on the streamed model (pipelines/dpo.py, pipelines/grpo.py),
the run's metrics in OUT/metrics.jsonl and its model in OUT/final; a summary line at the end."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipelines.post_run import EngineOptions


def _engine_flags(p: argparse.ArgumentParser, lr: float) -> None:
    p.add_argument("--model", required=True, help="HF model directory or hub name, with its tokenizer")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, final/ (and caches)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cpu-async[:SEED]")
    p.add_argument("--optimizer-workers", default="1", help="a count, or auto")
    p.add_argument("--seed", type=int, default=0)


def _engine_options(args: argparse.Namespace) -> EngineOptions:
    workers = args.optimizer_workers if args.optimizer_workers == "auto" else int(args.optimizer_workers)
    return EngineOptions(args.lr, args.weight_decay, args.max_grad_norm, args.warmup_steps, args.precision,
                         args.device, workers, args.seed)


def add_post_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser("dpo", help="DPO on preference pairs (TRL's format: prompt/chosen/rejected)")
    _engine_flags(p, lr=1e-6)
    p.add_argument("--data", required=True, help="JSONL of prompt/chosen/rejected records (text or chat messages)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs passes over the pairs)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-pairs", type=int, default=4, help="pairs per step (2x rows: chosen, then rejected)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--eval-fraction", type=float, default=0.1, help="pairs held out for the eval/ metrics")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (default: a fifth of the run)")
    p.set_defaults(func=cmd_dpo)

    p = subparsers.add_parser("grpo", help="GRPO with rollouts by the streamed model and TRL-style reward functions")
    _engine_flags(p, lr=1e-6)
    p.add_argument("--prompts", required=True, help="JSONL with a \"prompt\" column (text or chat messages)")
    p.add_argument("--reward", action="append", default=[], help="module.py:function (repeat for several)")
    p.add_argument("--reward-weights", type=float, nargs="+", help="one weight per --reward (default: 1 each)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (TRL's num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=100, help="rollout batches")
    p.add_argument("--iterations", type=int, default=1, help="optimisation steps per rollout batch")
    p.add_argument("--loss-type", choices=("grpo", "bnpo", "dr_grpo", "dapo"), default="dapo")
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--epsilon-high", type=float, help="default: --epsilon")
    p.add_argument("--beta", type=float, default=0.0, help="weight of the k3 KL to the initial policy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--scale-rewards", choices=("group", "batch", "none"), default="group")
    p.set_defaults(func=cmd_grpo)


def cmd_dpo(args: argparse.Namespace) -> int:
    from pipelines.dpo import DPOConfig, run_dpo

    cfg = DPOConfig(args.beta, args.steps, args.epochs, args.batch_pairs, args.max_length, args.eval_fraction,
                    args.eval_every, _engine_options(args))
    summary = run_dpo(args.model, args.data, args.out, cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "eval_first", "eval_last", "final")}))
    return 0


def cmd_grpo(args: argparse.Namespace) -> int:
    from pipelines.grpo import GRPOConfig, run_grpo

    cfg = GRPOConfig(args.group_size, args.max_new_tokens, args.prompts_per_step, args.steps, args.iterations,
                     args.loss_type, args.epsilon, args.epsilon_high, args.beta, args.temperature, args.top_p,
                     args.scale_rewards, args.reward_weights, _engine_options(args))
    summary = run_grpo(args.model, args.prompts, args.reward, args.out, cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "reward_first", "reward_last", "final")}))
    return 0
