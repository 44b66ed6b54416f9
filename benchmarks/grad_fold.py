"""A later micro-batch's weight gradient into the layer's fp32 buffer: its own GEMM then an add (as it was) against
the GEMM accumulating into the buffer (megatrain/engine/grad_fold.py), on one 7B-shaped weight (Llama-2-7B's
down_proj, 4096 x 11008, by default).

    python3 benchmarks/grad_fold.py --tokens 256 --repeats 5

Per dtype of the compute (the buffer is fp32 either way): "gemm + add" is x^T-weighted dL/dy into a tensor of the
compute dtype, then `buffer += it` (what autograd gave and the engine added); "folded" is
grad_fold.accumulate_weight_grad (fp32: addmm_ into the buffer; bf16 on CUDA: one GEMM from bf16 into fp32; bf16
on the CPU, which has no such GEMM, the same GEMM + add as before); "cast + addmm_" (bf16) is the fold the CPU could
do instead, both inputs cast to fp32 first; "add alone" is the pass over the buffer that the fold removes. Bytes per
parameter count what each reads and writes of the gradient's side (the GEMM's inputs, dL/dy and x, are read alike
by all). Best and median of --repeats timed runs after one untimed, the ways taking turns.
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
from megatrain.engine.grad_fold import accumulate_weight_grad


def gradient_bytes(way: str, size: int, device: torch.device) -> int:
    """Bytes per parameter each way reads and writes of the gradient's side, for a compute dtype of `size` bytes:
    a GEMM's output written in that dtype, an add's two reads and write of the fp32 buffer; a GEMM into the buffer
    reads and writes it once."""
    in_gemm = size == 4 or device.type == "cuda"  # where the fold is one GEMM (the CPU's bf16 fold is GEMM + add)
    return {"gemm + add": 2 * size + 8, "folded": 8 if in_gemm else 2 * size + 8, "cast + addmm_": 8,
            "add alone": size + 8}[way]


def interleaved_seconds(ways: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]
                        ) -> dict[str, list[float]]:
    """Each way timed `repeats` times, the ways taking turns (so that another job's load falls on all alike), after
    one untimed run of each."""
    times: dict[str, list[float]] = {way: [] for way in ways}
    for turn in range(repeats + 1):
        for way, fn in ways.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if turn:
                times[way].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--in-features", type=int, default=11008)
    parser.add_argument("--tokens", type=int, default=256, help="tokens of one micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = args.out_features * args.in_features
    gen = torch.Generator(device=device).manual_seed(0)
    buffer = torch.zeros(args.out_features, args.in_features, device=device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(args.tokens, args.out_features, device=device, generator=gen).to(dtype)
        x = torch.randn(args.tokens, args.in_features, device=device, generator=gen).to(dtype)
        temporary = grad.t().mm(x)
        ways: dict[str, Callable[[], object]] = {
            "gemm + add": lambda: buffer.add_(grad.t().mm(x)),  # noqa: B023 (run before the loop moves on)
            "folded": lambda: accumulate_weight_grad(buffer, grad, x),  # noqa: B023
            "add alone": lambda: buffer.add_(temporary),  # noqa: B023
        }
        if dtype == torch.bfloat16:
            ways["cast + addmm_"] = lambda: buffer.addmm_(grad.t().float(), x.float())  # noqa: B023
        size = dtype.itemsize
        for way, times in interleaved_seconds(ways, args.repeats, sync).items():
            nbytes = gradient_bytes(way, size, device)
            best = min(times)
            rows.append([str(dtype).removeprefix("torch."), way, str(nbytes), fmt(best, ".4f"),
                         fmt(statistics.median(times), ".4f"), fmt(nbytes * params / best / 1e9, ".1f")])
    print(machine_summary())
    print(f"{device}: weight {args.out_features} x {args.in_features} ({params / 1e6:.1f} M params), "
          f"{args.tokens} tokens, buffer fp32")
    print(format_table(["compute", "way", "bytes/param", "best s", "median s", "GB/s at best"], rows))


if __name__ == "__main__":
    main()
