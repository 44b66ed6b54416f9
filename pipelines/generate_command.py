"""`megatrain generate`: completions of prompts by an HF model, streamed layer by layer with a KV cache, as JSON lines
(Engine.generate; pipelines/generate.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatrain.config import RESIDENT_HELP


def add_generate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="complete prompts with an HF model, streamed, with a KV cache "
                                               "(JSON lines)")
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors weights)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt's text (repeat it for a batch)")
    p.add_argument("--prompts", help='a JSONL file, a prompt a line: {"prompt": text} or {"prompt_ids": [ids]}')
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sampled")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed: the same seed, the same tokens")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cpu-async[:SEED]")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    p.add_argument("--resident", default="auto", help=RESIDENT_HELP)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """One JSON line per prompt: its completion's text (where there is a tokenizer), token ids, finished."""
    from pipelines.engine import Engine
    from pipelines.generate import read_prompts

    prompts = read_prompts(args.prompt, args.prompts)
    resident = int(args.resident) if args.resident.isdigit() else args.resident
    longest = max(len(p) if isinstance(p, list) else len(p.encode()) for p in prompts)  # text: at most a token a byte
    with Engine(args.model, optimizer_workers=1, device=args.device, precision=args.precision, metrics=False,
                batch_size=len(prompts), seq_len=longest + args.max_new_tokens, resident=resident) as engine:
        out = engine.generate(prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    for i in range(len(out)):
        row: dict[str, Any] = {"completion": out.texts[i]} if out.texts is not None else {}
        row.update(token_ids=out.token_ids[i], finished=out.finished[i])
        print(json.dumps(row))
    return 0
