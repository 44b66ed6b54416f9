"""Host <-> GPU copy rates: megatrain's arena segment (registered and not) against pageable and pinned memory.

    python3 benchmarks/pcie.py --size-mb 1024 --repeats 10

The arena is the path weights and gradients take: a /dev/shm file mapped with torch.from_file and page-locked
with cudaHostRegister (Arena.register_cuda) in the process that copies. Pageable is a plain torch.empty;
pinned is torch.empty(pin_memory=True) (CUDA's caching host allocator). Each copy is timed on the host
clock between two synchronisations; "both" runs an H2D and a D2H of the same size at once on two streams
(what the executor's h2d and d2h streams do in backward) and counts the bytes of both. The timing is
megatrain/perf/calibrate.py's, which `megatrain doctor` runs on a small arena.
Needs CUDA: without it the script says so and measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import fmt, format_table, machine_summary
from megatrain.perf.calibrate import CopyRates, arena_copy_rates, copy_rates


def row(name: str, rates: CopyRates) -> list[str]:
    """One table row: best and median GB/s of H2D, D2H and both at once ("-" where not measured)."""
    cells = [name]
    for r in (rates.h2d, rates.d2h, rates.both):
        cells += [fmt(max(r), ".1f"), fmt(statistics.median(r), ".1f")] if r else ["-", "-"]
    return cells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="bytes per copy, in MiB")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pcie: needs CUDA (torch.cuda.is_available() is False); nothing measured.")
        return 0
    numel = args.size_mb * 2**20 // 4
    print(f"pcie: {args.size_mb} MiB per copy, {args.repeats} timed copies each, GB/s = 10^9 B/s")
    print(f"machine: {machine_summary()}; GPU {torch.cuda.get_device_name()}")
    rows = []
    pageable_src, pageable_dst = torch.randn(numel), torch.empty(numel)
    rows.append(row("pageable (torch.empty)", copy_rates(pageable_src, pageable_dst, args.repeats, both=False)))
    del pageable_src, pageable_dst
    pinned_src = torch.empty(numel, pin_memory=True).normal_()
    pinned_dst = torch.empty(numel, pin_memory=True)
    rows.append(row("pinned (pin_memory=True)", copy_rates(pinned_src, pinned_dst, args.repeats)))
    del pinned_src, pinned_dst
    arena = arena_copy_rates(numel, args.repeats)  # a fresh arena: params, grads, exp_avg, exp_avg_sq of numel
    rows.append(row("arena /dev/shm, not registered", arena.pageable))
    label = "arena /dev/shm, cudaHostRegister" + ("" if arena.registered else " FAILED (see warning)")
    rows.append(row(label, arena.pinned))
    print()
    print(format_table(["host memory", "H2D best", "H2D median", "D2H best", "D2H median", "both best",
                        "both median"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
