"""Decoding GPT-OSS's MXFP4 experts as they load (megatrain/io/mxfp4.py): experts of the published tensors' shapes
(gate_up_proj: 5,760 rows of 2,880 values; down_proj: 2,880 of 2,880) decoded expert by expert into an fp32 slot,
the fp32 bytes written per second, and what that rate gives for every expert tensor of GPT-OSS-20B and -120B.

    python3 benchmarks/mxfp4_load.py --experts 4 --repeats 3

Best and median of --repeats timed runs after one untimed; random codes and scales (the decode's work does not
depend on the values). The disk's read of the packed bytes (a quarter of a byte per value, plus a scale per 32)
comes on top: it is the checkpoint reader's, not the decode's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import fmt, format_table, machine_summary
from megatrain.io.mxfp4 import BLOCK, Mxfp4Weight

HIDDEN = INTERMEDIATE = 2880  # both GPT-OSS models
TENSORS = {"gate_up_proj": (2 * INTERMEDIATE, HIDDEN), "down_proj": (HIDDEN, INTERMEDIATE)}  # (rows out, values in)
MODELS = {"gpt-oss-20b": 24 * 32, "gpt-oss-120b": 36 * 128}  # layers x experts


def packed(experts: int, rows: int, values: int, gen: torch.Generator) -> Mxfp4Weight:
    blocks = torch.randint(0, 256, (experts, rows, values // BLOCK, BLOCK // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 130, (experts, rows, values // BLOCK), generator=gen, dtype=torch.uint8)
    return Mxfp4Weight("bench", blocks, scales)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=4, help="experts decoded per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="divide both widths by this (a quick run)")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows, seconds_per_expert = [], {}
    for name, (out, values) in TENSORS.items():
        out, values = out // args.scale, values // args.scale // BLOCK * BLOCK
        weight = packed(args.experts, out, values, gen)
        slot = torch.empty(weight.shape)
        times = []
        for turn in range(args.repeats + 1):
            start = time.perf_counter()
            weight.dequantize_into(slot)
            if turn:
                times.append(time.perf_counter() - start)
        best = min(times)
        seconds_per_expert[name] = best / args.experts * args.scale**2
        rows.append([name, f"{args.experts} x {values} x {out}", fmt(best, ".3f"), fmt(statistics.median(times), ".3f"),
                     fmt(slot.numel() * 4 / best / 1e9, ".2f")])
    print(machine_summary())
    print(f"torch threads: {torch.get_num_threads()}")
    print(format_table(["tensor", "experts x in x out", "best s", "median s", "fp32 GB/s at best"], rows))
    whole = sum(seconds_per_expert.values())
    for model, experts in MODELS.items():
        print(f"{model}: {experts} experts x 2 tensors decode in ~{experts * whole / 60:.1f} min at that rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
