"""Host <-> GPU copy rates: megatrain's arena segment (registered and not) against pageable and pinned memory.

    python3 benchmarks/pcie.py --size-mb 1024 --repeats 10

The arena is the path weights and gradients take: a /dev/shm file mapped with torch.from_file and page-locked
with cudaHostRegister (Arena.register_cuda) in the process that copies. Pageable is a plain torch.empty;
pinned is torch.empty(pin_memory=True) (CUDA's caching host allocator). Each copy is timed on the host
clock between two synchronisations; "both" runs an H2D and a D2H of the same size at once on two streams
(what the executor's h2d and d2h streams do in backward) and counts the bytes of both.
Needs CUDA: without it the script says so and measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import fmt, format_table, machine_summary


def rates(copy: Callable[[], None], nbytes: int, repeats: int) -> list[float]:
    """GB/s (10^9 B/s) of `repeats` runs of copy(), after one untimed run."""
    copy()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def measure(name: str, src: torch.Tensor, dst: torch.Tensor, repeats: int, both: bool) -> list[str]:
    """One table row: H2D from `src`, D2H into `dst` (host tensors of equal size), and both at once."""
    gpu_in, gpu_out = torch.empty_like(src, device="cuda"), torch.empty_like(dst, device="cuda")
    gpu_out.fill_(1)
    nbytes = src.numel() * src.element_size()
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        with torch.cuda.stream(h2d_stream):
            gpu_in.copy_(src, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(d2h_stream):
            dst.copy_(gpu_out, non_blocking=True)

    def h2d_and_d2h() -> None:
        h2d()
        d2h()

    row = [name]
    for fn, n in ((h2d, nbytes), (d2h, nbytes)):
        r = rates(fn, n, repeats)
        row += [fmt(max(r), ".1f"), fmt(statistics.median(r), ".1f")]
    if both:
        r = rates(h2d_and_d2h, 2 * nbytes, repeats)
        row += [fmt(max(r), ".1f"), fmt(statistics.median(r), ".1f")]
    else:
        row += ["-", "-"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="bytes per copy, in MiB")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pcie: needs CUDA (torch.cuda.is_available() is False); nothing measured.")
        return 0
    from megatrain.memory.arena import Arena

    numel = args.size_mb * 2**20 // 4
    print(f"pcie: {args.size_mb} MiB per copy, {args.repeats} timed copies each, GB/s = 10^9 B/s")
    print(f"machine: {machine_summary()}; GPU {torch.cuda.get_device_name()}")
    rows = []
    pageable_src, pageable_dst = torch.randn(numel), torch.empty(numel)
    rows.append(measure("pageable (torch.empty)", pageable_src, pageable_dst, args.repeats, both=False))
    del pageable_src, pageable_dst
    pinned_src = torch.empty(numel, pin_memory=True).normal_()
    pinned_dst = torch.empty(numel, pin_memory=True)
    rows.append(measure("pinned (pin_memory=True)", pinned_src, pinned_dst, args.repeats, both=True))
    del pinned_src, pinned_dst
    arena = Arena.create(numel)  # params, grads, exp_avg, exp_avg_sq segments of numel fp32 each
    try:
        arena.params.normal_()
        rows.append(measure("arena /dev/shm, not registered", arena.params, arena.grads, args.repeats,
                            both=False))
        registered = arena.register_cuda(("params", "grads"))
        label = "arena /dev/shm, cudaHostRegister" + ("" if registered else " FAILED (see warning)")
        rows.append(measure(label, arena.params, arena.grads, args.repeats, both=True))
    finally:
        arena.destroy()
    print()
    print(format_table(["host memory", "H2D best", "H2D median", "D2H best", "D2H median", "both best",
                        "both median"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
