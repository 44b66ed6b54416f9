"""Soak: a long run of a small model with an actor SIGKILLed every ~100 steps, against an uninterrupted run.

    python tests/soak/soak.py --steps 2000 --kill-every 100

Prints faults injected, faults survived, steps lost (recomputed from a checkpoint), and the largest
difference of any final parameter from the uninterrupted run (must be 0). Exits 1 if it is not 0 or the
run left shared memory or actors behind.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import megatrain  # noqa: E402
from megatrain.memory.arena import list_segments  # noqa: E402


def run(args: argparse.Namespace, batches: list[torch.Tensor], out: Path, inject: bool) -> dict:
    rng = random.Random(args.seed)
    injected = 0
    t0 = time.monotonic()
    with megatrain.Engine(args.model, lr=1e-3, warmup_steps=50, total_steps=args.steps, optimizer_workers=2,
                          precision="fp32", device="cpu", seed=args.seed, grads=args.grads,
                          max_grad_norm=args.max_grad_norm) as engine:
        next_kill = rng.randint(args.kill_every // 2, args.kill_every * 3 // 2)
        for step, ids in enumerate(batches):
            killer = None
            if inject and step == next_kill:
                victim = rng.choice(["executor", "worker"])
                if victim == "executor":  # each actor tells its own pid
                    pid = ray.get(engine.executor.pid.remote())
                else:
                    pid = rng.choice(ray.get([w.pid.remote() for w in engine.workers]))
                killer = threading.Timer(rng.uniform(0.0, 0.05), os.kill, (pid, signal.SIGKILL))
                killer.start()
                injected += 1
                next_kill += rng.randint(args.kill_every // 2, args.kill_every * 3 // 2)
            loss = engine.step(ids)
            if killer is not None:
                killer.join()
            if (step + 1) % args.checkpoint_every == 0:
                engine.save_checkpoint(out / f"step-{step + 1}")
            if (step + 1) % 200 == 0:
                print(f"  {'faulty' if inject else 'clean '} step {step + 1}: loss {loss:.4f} "
                      f"restarts {engine.restarts}", flush=True)
        return {"params": engine.parameters(), "injected": injected, "survived": engine.restarts,
                "lost": engine.replayed_steps, "seconds": time.monotonic() - t0, "run_id": engine.handle.run_id}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kill-every", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grads", default="auto", help="where gradients wait: auto | arena | stream | device")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: clipping off")
    parser.add_argument("--out", default="/tmp/megatrain-soak")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=256 * 2**20)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, 256, (4, 64), generator=gen) for _ in range(args.steps)]
    clean = run(args, batches, Path(args.out) / "clean", inject=False)
    faulty = run(args, batches, Path(args.out) / "faulty", inject=True)
    diff = max((clean["params"][n] - faulty["params"][n]).abs().max().item() for n in clean["params"])
    leftovers = [p for p in list_segments() if clean["run_id"] in p.name or faulty["run_id"] in p.name]
    ray.shutdown()
    print(f"steps {args.steps}; faults injected {faulty['injected']}, faults survived {faulty['survived']}, "
          f"steps lost {faulty['lost']}; final-parameter max |difference| {diff}; "
          f"time clean {clean['seconds']:.0f}s, with faults {faulty['seconds']:.0f}s; "
          f"shared-memory leftovers {len(leftovers)}")
    return 0 if diff == 0 and not leftovers and faulty["survived"] >= faulty["injected"] else 1


if __name__ == "__main__":
    sys.exit(main())
