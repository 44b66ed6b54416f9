"""A run's host bytes per parameter and its checkpoint speeds, with states on NVMe against in host memory.

    python3 benchmarks/nvme_run.py --nvme DIR --model 125m --cases fp32:moments,grads bf16:all fp32: --out run.json

Each case (precision:nvme_states, nothing after the colon: every state in host memory) is an Engine of the model
(random weights, 2 optimizer workers, clipping on, 1 x --seq tokens a step) that runs --steps steps while a thread
sums the allocated pages of every arena segment of the run every 20 ms (the peak, and after the steps); then it
times save_checkpoint, load_checkpoint and save_pretrained in a directory beside DIR (same disk), each file's pages
dropped from the page cache once written, so the load reads the disk; beside the disk's raw sequential GB/s
(benchmarks/nvme.py raw_rates).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def model_config(name: str):  # noqa: ANN201 - ModelConfig, imported late
    """A preset, or "162m": the 125m preset's vocabulary and heads' width at 384 wide and 48 layers (162.6 M)."""
    from megatrain.config import ModelConfig

    if name == "162m":
        return replace(ModelConfig.from_name("125m"), hidden_size=384, intermediate_size=1984, num_heads=6,
                       num_kv_heads=6, num_layers=48)
    return ModelConfig.from_name(name)


class PageSampler:
    """Allocated bytes of every arena segment of a run (st_blocks: what /dev/shm holds of them), every 20 ms."""

    def __init__(self, handle: object):
        self.paths = [handle.path(name) for name, _, _ in handle.segments]
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def now(self) -> int:
        return sum(os.stat(p).st_blocks * 512 for p in self.paths if p.exists())

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def written(path: Path) -> int:
    """Bytes of the files under `path`, each dropped from the page cache (they are fsynced: clean pages)."""
    total = 0
    for f in (p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += f.stat().st_size
    return total


def timed(work: object) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def run_case(config: object, precision: str, states: str, nvme: Path, seq: int, steps: int) -> dict:
    """One Engine: host bytes per parameter over its steps, then its checkpoint save, load and export speeds."""
    import torch

    import megatrain

    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    tier = dict(nvme=str(nvme), nvme_states=states) if states else {}
    target = nvme.parent / f"{nvme.name}-ckpt-{uuid.uuid4().hex[:6]}"
    result: dict = {"precision": precision, "nvme_states": states or "none"}
    try:
        with megatrain.Engine(config, precision=precision, device="cpu", optimizer_workers=2, batch_size=1,
                              seq_len=seq, max_grad_norm=1.0, metrics=False, **tier) as engine:
            params = config.num_params()
            sampler = PageSampler(engine.handle)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step(ids)
            engine.wait_for_updates()
            result["step_s"] = (time.perf_counter() - t0) / steps
            after, peak = sampler.now(), sampler.close()
            result.update(params=params, arena_after_b_per_param=after / params, arena_peak_b_per_param=peak / params,
                          staging_bytes=sum(n * 4 for name, _, n in engine.handle.segments
                                            if name.startswith("stage_")))
            for what, work, path in (("save", lambda: engine.save_checkpoint(target), target),
                                     ("load", lambda: engine.load_checkpoint(target), None),
                                     ("export", lambda: engine.save_pretrained(target / "final"), target / "final")):
                seconds = timed(work)
                if path is not None:
                    result[f"{what}_bytes"] = written(path)
                nbytes = result[f"{what}_bytes"] if path is not None else result["save_bytes"]
                result[f"{what}_s"], result[f"{what}_gbps"] = seconds, nbytes / seconds / 1e9
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme", required=True, type=Path, help="a directory on the disk (ext4, xfs, ...)")
    p.add_argument("--model", default="125m", help="a preset, or 162m (48 layers of 384)")
    p.add_argument("--cases", nargs="+", default=["fp32:", "fp32:moments,grads", "bf16:all"])
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--raw-gib", type=float, default=1.0, help="bytes each way of the raw rate (0: not measured)")
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    from benchmarks.nvme import raw_rates

    config = model_config(args.model)
    out: dict = {"model": args.model, "load_1min_at_start": os.getloadavg()[0], "cases": []}
    if args.raw_gib:
        out["raw_write_gbps"], out["raw_read_gbps"] = raw_rates(args.nvme, int(args.raw_gib * 2**30))
        print(f"raw {args.nvme}: write {out['raw_write_gbps']:.2f} GB/s, read {out['raw_read_gbps']:.2f} GB/s")
    for case in args.cases:
        precision, _, states = case.partition(":")
        r = run_case(config, precision, states, args.nvme, args.seq, args.steps)
        out["cases"].append(r)
        print(f"{args.model} ({r['params'] / 1e6:.1f} M) {precision} nvme_states={r['nvme_states']}: host "
              f"{r['arena_after_b_per_param']:.2f} B/param after the steps, peak {r['arena_peak_b_per_param']:.2f} "
              f"(staging {r['staging_bytes'] / 2**20:.0f} MiB); step {r['step_s']:.2f} s; save "
              f"{r['save_gbps']:.2f} GB/s ({r['save_s']:.2f} s), load {r['load_gbps']:.2f} ({r['load_s']:.2f} s), "
              f"export {r['export_gbps']:.2f} ({r['export_s']:.2f} s)")
    out["load_1min_at_end"] = os.getloadavg()[0]
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
