"""A driver script: `ray start --head` once, then `python examples/train_driver.py`.

Without --address it joins the cluster `ray start` runs on this machine, or starts a private Ray when there is
none (`--address local` always does). Trains the tiny preset on the synthetic data set through the
data-loader actor, placed on the run's node, prints the loss, saves a checkpoint and an HF directory.
"""

from __future__ import annotations

import argparse

import megatrain
from actors.data_loader import DataLoaderActor
from megatrain.data import DataConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default=None, help="auto | host:port | local (default: as megatrain train)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="runs/driver")
    args = parser.parse_args()

    with megatrain.Engine(args.model, lr=3e-3, warmup_steps=10, total_steps=args.steps, optimizer_workers=2,
                          precision="tf32", address=args.address) as engine:
        # on the run's node, beside the executor it feeds
        data = DataLoaderActor.options(scheduling_strategy=engine.scheduling_strategy).remote(
            DataConfig(batch_size=8, seq_len=256, vocab_size=engine.config.vocab_size))
        for step in range(args.steps):
            result = engine.step_batch(data.next_batch.remote())  # the batch goes actor to actor by reference
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step}: loss {result.loss:.4f} grad-norm {result.grad_norm:.3f}")
        engine.save_checkpoint(f"{args.out}/checkpoint")
        engine.save_pretrained(f"{args.out}/hf")
    print(f"saved {args.out}/checkpoint and {args.out}/hf")


if __name__ == "__main__":
    main()
