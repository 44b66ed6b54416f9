"""The CPU optimizer pool in parameters per second: N OptimizerWorker actors x (cores // N) threads.

    python3 benchmarks/optimizer.py --params 1e9 --workers 1,2,4,8,16 --repeats 5 --out optimizer.json

For each N: an arena laid out like a Llama model of about --params parameters (so every worker walks the
same units and tensor groups it walks in training), N `actors.optimizer_worker.OptimizerWorker` actors,
and the wall-clock time of one `apply()` on all of them (every unit, forward order; the update of one
training step). One untimed apply first (page faults on first touch), then --repeats timed ones; best and
median are reported. Beside them, the single-process reference: torch.optim.AdamW(fused=True) over the
same tensors with all cores' threads, in this process (megatrain/perf/calibrate.py's timing, which `megatrain
doctor` runs small).

First, one pass against three (issue #25), in this process with every core's threads: one worker's update of the
whole arena (AdamWShard, the bf16 copy written as in bf16 runs), with and without a clip scale, walked in pieces
of PIECE_NUMEL elements (the clip scale, the fused AdamW and the bf16 copy on each piece while it is in the cache)
against pieces as large as a unit's decay group (the update as it was: each step a pass of its own), the
rollback of the update beside the backward (the coefficient-1 update taken back and the clipped one applied, in
one pass), and the update keeping a copy of what it overwrites (what an exact rollback would cost every step).
Bytes per parameter are what each reads and writes of memory where a pass's data is not in the cache.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import GiB, fmt, format_table, machine_summary, pythonpath_with_repo
from megatrain.config import OptimConfig
from megatrain.engine.optimizer import PIECE_NUMEL, AdamWShard
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.model.layout import ALIGN, ModelLayout
from megatrain.perf.calibrate import config_for_params, fill, fused_adamw_seconds


@dataclass
class Timing:
    setup: str  # "pool 4 x 4" or the reference
    workers: int  # 0 for the single-process reference
    threads: int  # per worker
    times: list[float]  # seconds of each timed update of the whole arena

    def rate(self, numel: int, which: str) -> float:
        t = min(self.times) if which == "best" else statistics.median(self.times)
        return numel / t


def reference(layout: ModelLayout, optim: OptimConfig, repeats: int) -> Timing:
    """torch.optim.AdamW(fused=True) over the layout's tensors in this process, every core's thread."""
    threads = os.cpu_count() or 1
    times = fused_adamw_seconds(layout, optim, repeats, threads)
    return Timing(f"torch.optim.AdamW(fused=True), 1 process x {threads} threads", 0, threads, times)


@dataclass
class PassTiming:
    update: str  # "one pass", "three passes", "rollback"
    clip: bool  # a clip scale below 1 (the gradient scaled, and written back, first)
    bytes_per_param: int  # read + written per parameter where a pass's data is not in the cache
    times: list[float]  # seconds of each timed update of the whole arena


class KeepingACopy(AdamWShard):
    """The exact alternative to the closed-form rollback, for comparison: each piece's weights and moments copied
    aside just before its update (in the same pass), so that taking the update back would be a copy."""

    def __init__(self, layout: ModelLayout, tensors: dict[str, torch.Tensor], optim: OptimConfig) -> None:
        super().__init__(layout, tensors, optim, 0, 1)
        pieces = [p for pair in self.groups for group in pair for p in group]
        room = torch.empty(3 * self.numel)
        self.copies, at = {}, 0
        for piece in pieces:
            state = piece.params + piece.exp_avg + piece.exp_avg_sq
            self.copies[id(piece)] = [room[at + sum(t.numel() for t in state[:i]) :][: t.numel()]
                                      for i, t in enumerate(state)]
            at += 3 * piece.numel

    def _invert(self, piece: Any, grads: Any, step: int, lr: float, weight_decay: float) -> None:  # first: copy
        torch._foreach_copy_(self.copies[id(piece)], piece.params + piece.exp_avg + piece.exp_avg_sq)


def pass_bytes(update: str, clip: bool, bf16_copy: bool = True) -> int:
    """Bytes of memory traffic per parameter: the fused AdamW reads p, g, m, v (16) and writes p, m, v (12); the clip
    scale reads and writes g (8: 4 where the piece is still in the cache for AdamW, which only writes it back); the
    bf16 copy reads p and writes it in bf16 (6: 2 in the cache). A rollback reads and writes what a clipped update
    does, in one pass."""
    one = update != "three passes"
    copy = 12 if update == "one pass + copy" else 0  # and as many read where the cache allocates on a write
    return 28 + copy + (clip or update == "rollback") * (4 if one else 8) + bf16_copy * (2 if one else 6)


def passes(layout: ModelLayout, optim: OptimConfig, repeats: int, threads: int) -> list[PassTiming]:
    """One worker's update of every unit of `layout` in this process with `threads` threads (a bf16 copy as in bf16
    runs): in pieces of PIECE_NUMEL (one pass), in pieces as large as a unit's decay group (three passes: as it was
    before issue #25), the rollback of an update beside the backward, and the update keeping a copy of what it
    overwrites (the exact rollback's price on every step); one untimed update first."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tensors = {name: torch.empty(layout.numel) for name in ("params", "grads", "exp_avg", "exp_avg_sq")}
        fill(tensors["params"], tensors["grads"])
        tensors["exp_avg"].zero_()
        tensors["exp_avg_sq"].zero_()
        tensors[BF16_COPY_SEGMENT] = torch.empty(layout.numel, dtype=torch.bfloat16)
        whole = -(-max(u.numel for u in layout.units) // ALIGN) * ALIGN
        shards = {"one pass": AdamWShard(layout, tensors, optim, 0, 1),
                  "three passes": AdamWShard(layout, tensors, optim, 0, 1, piece_numel=whole)}
        units = [u.index for u in layout.units]
        out = []
        step = 0
        for clip in (False, True):
            coef = 0.999 if clip else 1.0  # a scale near 1: the gradients keep their size over the repeats
            for name, shard in shards.items():
                times = []
                for r in range(repeats + 1):
                    t0 = time.perf_counter()
                    for u in units:
                        shard.update(u, step, coef)
                    step += 1
                    if r:
                        times.append(time.perf_counter() - t0)
                out.append(PassTiming(name, clip, pass_bytes(name, clip), times))
        times = []
        for r in range(repeats + 1):  # each time: every unit updated beside the backward, then the step clips
            for u in units:
                shards["one pass"].speculate(u, step, speculation=r)
            t0 = time.perf_counter()
            for u in units:
                shards["one pass"].settle(u, step, 0.999, speculation=r)
            step += 1
            if r:
                times.append(time.perf_counter() - t0)
        out.append(PassTiming("rollback", True, pass_bytes("rollback", True), times))
        copying, times = KeepingACopy(layout, tensors, optim), []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for u in units:
                copying._pass(u, step, 1.0, roll_back=True, update=True)
            step += 1
            if r:
                times.append(time.perf_counter() - t0)
        out.append(PassTiming("one pass + copy", False, pass_bytes("one pass + copy", False), times))
        return out
    finally:
        torch.set_num_threads(before)


def passes_table(timings: list[PassTiming], numel: int) -> str:
    headers = ["update", "clip", "bytes/param", "best s", "median s", "best G params/s", "median G params/s",
               "GB/s at best"]
    rows = []
    for t in timings:
        best, median = numel / min(t.times), numel / statistics.median(t.times)
        rows.append([t.update, "yes" if t.clip else "no", str(t.bytes_per_param), fmt(min(t.times), ".4f"),
                     fmt(statistics.median(t.times), ".4f"), fmt(best / 1e9, ".3f"), fmt(median / 1e9, ".3f"),
                     fmt(best * t.bytes_per_param / 1e9, ".1f")])
    return format_table(headers, rows)


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def pool(layout: ModelLayout, optim: OptimConfig, workers: int, repeats: int) -> Timing:
    """N optimizer-worker actors on a fresh arena; the wall time of apply() on all of them."""
    import ray

    from actors.optimizer_worker import OptimizerWorker
    from megatrain.memory.arena import Arena
    from megatrain.run_plan import WorkerPlan

    cores = os.cpu_count() or 1
    threads = max(1, cores // workers)
    per_worker = min(threads, cores / workers)  # Ray CPUs per actor: fractional when workers > cores
    versions = ("versions", "int64", len(layout.units) * workers)  # what the workers mark as updated
    arena = Arena.create(layout.numel, extra_segments=(versions,))
    actors = []
    try:
        fill(arena.params, arena.grads)
        actor = OptimizerWorker.options(num_cpus=per_worker)
        plan = WorkerPlan(optim, workers, threads)
        actors = [actor.remote(arena.handle, layout, plan, w) for w in range(workers)]
        ray.get([a.numel.remote() for a in actors])  # all started before the clock runs
        times = []
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            ray.get([a.apply.remote(step, 1.0) for a in actors])
            if step > 0:  # step 0 first-touches each worker's shard of the moments
                times.append(time.perf_counter() - t0)
        return Timing(f"pool {workers} x {threads}", workers, threads, times)
    finally:
        pids = []
        for a in actors:
            try:
                pids.append(ray.get(a.__ray_call__.remote(lambda actor: os.getpid()), timeout=10))
            except Exception:  # no __ray_call__ (older Ray) or already gone: nothing to wait for
                pass
            ray.kill(a)
        deadline = time.monotonic() + 30  # let them exit (and drop their arena mapping) before the next N
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        arena.destroy()


def progress(t: Timing, numel: int) -> str:
    """A setup's line as soon as it is measured: a run cut short (a runbook step's timeout) still says it."""
    return (f"  {t.setup}: {t.rate(numel, 'best') / 1e9:.3f} G params/s best, "
            f"{t.rate(numel, 'median') / 1e9:.3f} median")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e9, help="arena size in parameters (approximate)")
    ap.add_argument("--workers", default="1,2,4,8,16", help="comma-separated pool sizes")
    ap.add_argument("--repeats", type=int, default=5, help="timed updates per pool size")
    ap.add_argument("--no-reference", action="store_true", help="skip the torch.optim.AdamW reference")
    ap.add_argument("--no-passes", action="store_true", help="skip one pass against three")
    ap.add_argument("--object-store-mb", type=int, default=128, help="Ray's object store size")
    ap.add_argument("--out", help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("--workers takes positive integers, e.g. 1,2,4,8,16")
    config = config_for_params(args.params)
    layout = ModelLayout.build(config)
    optim = OptimConfig()
    numel = layout.numel
    print(f"optimizer: fused AdamW over {numel:,} fp32 parameters ({16 * numel / GiB:.2f} GiB arena: params, "
          f"grads, m, v); Llama shape hidden {config.hidden_size}, {config.num_layers} layers, "
          f"{len(layout.units)} units; {args.repeats} timed updates each", flush=True)
    print(f"machine: {machine_summary()}", flush=True)
    passes_timings = []
    if not args.no_passes:  # before Ray starts, so nothing else is on the cores
        print(f"one pass against three: one worker x {os.cpu_count()} threads, pieces of {PIECE_NUMEL} elements",
              flush=True)
        passes_timings = passes(layout, optim, args.repeats, os.cpu_count() or 1)
        print(passes_table(passes_timings, numel), flush=True)
        print(flush=True)
    timings = []
    if not args.no_reference:  # before Ray starts, so nothing else is on the cores
        timings.append(reference(layout, optim, args.repeats))
        print(progress(timings[-1], numel), flush=True)
    import ray

    os.environ["PYTHONPATH"] = pythonpath_with_repo()  # inherited by Ray's workers, which import actors/
    ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=args.object_store_mb * 2**20,
             include_dashboard=False, configure_logging=False)
    try:
        for n in counts:
            timings.append(pool(layout, optim, n, args.repeats))
            print(progress(timings[-1], numel), flush=True)
    finally:
        ray.shutdown()

    base = next((t for t in timings if t.workers == 1), None)
    headers = ["setup", "workers", "threads each", "best s", "median s", "best G params/s",
               "median G params/s", "vs 1 worker"]
    rows = []
    for t in timings:
        speedup = t.rate(numel, "median") / base.rate(numel, "median") if base else None
        rows.append([t.setup, str(t.workers or "-"), str(t.threads), fmt(min(t.times), ".4f"),
                     fmt(statistics.median(t.times), ".4f"), fmt(t.rate(numel, "best") / 1e9, ".3f"),
                     fmt(t.rate(numel, "median") / 1e9, ".3f"), f"{speedup:.2f}x" if speedup else "-"])
    print()
    print(format_table(headers, rows))
    if args.out:
        out = {"date": datetime.date.today().isoformat(), "machine": machine_summary(), "numel": numel,
               "config": config.to_dict(), "timings": [asdict(t) for t in timings],
               "passes": [asdict(t) for t in passes_timings]}
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
