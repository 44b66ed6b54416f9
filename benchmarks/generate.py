"""Generation tokens/s by the streamed model (Engine.generate, megatrain/engine/generation.py): a batch of prompts of
random tokens, greedy, no end-of-sequence token (every row runs to --new tokens), with the units that fit the device
kept there for the call (the default) and with every unit but the resident ones streamed for every token, each timed
after a warm-up call. Prints one JSON object (and writes it to --out): per mode the seconds, the new tokens a second
(rows x new / seconds), the seconds a decoded step takes, and the units each executor kept.

    python3 benchmarks/generate.py --model 7b --precision bf16 --rows 8 --prompt 128 --new 64 --out gen-7b.json

The prediction this checks (issue #45): streaming every layer for every token, a 7B bf16 model's 14 GB cross PCIe
at ~55 GB/s in ~0.25 s a step (~0.16 s with the H2D rate of an H200); with every unit held, a step is its compute.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def timed(engine: Any, prompts: list[list[int]], new: int, hold: bool) -> dict[str, Any]:
    engine.generate(prompts, 2, eos_token_ids=[], hold_weights=hold)  # warm-up: buffers, kernels
    t0 = time.perf_counter()
    out = engine.generate(prompts, new, eos_token_ids=[], hold_weights=hold)
    seconds = time.perf_counter() - t0
    tokens = sum(len(t) for t in out.token_ids)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "s_per_step": seconds / new,
            "held_units": [len(h) for h in out.held_units], "held_gib": [b / 2**30 for b in out.held_bytes]}


def main(argv: list[str] | None = None) -> int:
    import megatrain

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="7b", help="a preset name or an HF directory")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="tokens a prompt")
    p.add_argument("--new", type=int, default=64, help="new tokens a row")
    p.add_argument("--optimizer-workers", default="auto")
    p.add_argument("--out")
    args = p.parse_args(argv)
    workers = args.optimizer_workers if args.optimizer_workers == "auto" else int(args.optimizer_workers)
    with megatrain.Engine(args.model, precision=args.precision, device=args.device, optimizer_workers=workers,
                          batch_size=args.rows, seq_len=args.prompt + args.new, metrics=False) as engine:
        vocab = engine.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (args.rows, args.prompt), generator=gen).tolist()
        result = {"model": args.model, "precision": args.precision, "rows": args.rows, "prompt": args.prompt,
                  "new": args.new, "device": engine.device, "resident_units": engine.run_plan.resident_units,
                  "held": timed(engine, prompts, args.new, True), "streamed": timed(engine, prompts, args.new, False)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
