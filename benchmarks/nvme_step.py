"""A training step bound by the disk against the step `megatrain plan` predicts for it with the disk as a bound.

    python3 benchmarks/nvme_step.py --nvme /path/on/nvme --out nvme_step.json

The model is wide and shallow with a byte vocabulary (default 8 layers of width 2048, 0.54 G parameters), trained in
fp32 with clipping on at 1 x 8 tokens a step: little compute, while its Adam moments on --nvme move 16 bytes a
parameter a step (each unit's m and v read before its update and written back after it). In order:

1. the disk: `megatrain calibrate --nvme PATH` (the tier's own direct I/O, --nvme-gib each way), cached where the
   plan reads it;
2. the plan: `megatrain plan --json` of that run (its own CPU calibration, quick, where none is cached for this
   shape), the predicted step with the disk as a bound as `megatrain plan` prints it: the tier's read and write
   bytes at the calibrated rates hide behind the compute the update runs beside (the backward, or the serial
   walk's next forward), the rest adds to the predicted step (TierPlan.bound_s);
3. the run: an Engine of the same settings, --steps steps, each timed to its updates' end; the first left out (its
   moments are zeros, read from no disk), the mean and the median of the rest against the prediction.

Every calibration goes to files under --work (MEGATRAIN_CALIBRATION, MEGATRAIN_NVME_RATES), removed at the end.
The load average is recorded beside each number: other processes share the cores and the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def model_dir(work: Path, hidden: int, layers: int, ffn: int) -> Path:
    """An HF config.json of the benchmark's model (Llama, byte vocabulary), for `megatrain plan --model DIR`."""
    from megatrain.config import ModelConfig

    config = replace(ModelConfig.from_name("1b"), hidden_size=hidden, num_layers=layers, intermediate_size=ffn,
                     num_heads=hidden // 128, num_kv_heads=hidden // 128, vocab_size=256)
    directory = work / "model"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    return directory


def planned(model: Path, nvme: Path, seq: int, workers: int) -> dict:
    """`megatrain plan --json` of the run, and its step with the disk as a bound."""
    from pipelines.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--model", str(model), "--batch", "1", "--seq", str(seq), "--precision", "fp32", "--device",
              "cpu", "--optimizer-workers", str(workers), "--max-grad-norm", "1.0", "--nvme", str(nvme),
              "--nvme-states", "moments", "--json"])
    plan = json.loads(out.getvalue())
    tier = plan["plan"]["tier"]
    disk_s = tier["read_bytes"] / (tier["read_gbps"] * 1e9) + tier["write_bytes"] / (tier["write_gbps"] * 1e9)
    step_s = plan["predicted_step_s"]
    return {"predicted_step_s": step_s, "disk_s": disk_s, "predicted_with_disk_s": plan["predicted_with_disk_s"],
            "beside_update_s": plan["beside_update_s"],
            "nvme_gib_per_step": (tier["read_bytes"] + tier["write_bytes"]) / 2**30, "params": plan["plan"]["params"],
            "read_gbps": tier["read_gbps"], "write_gbps": tier["write_gbps"],
            "host_bytes_per_param": plan["plan"]["host_total"] / plan["plan"]["params"],
            "compute_source": plan.get("compute_source")}


def disk_bytes(directory: Path) -> tuple[int, int]:
    """(read, written) bytes so far of the block device holding `directory` (/proc/diskstats: 512-byte sectors), all
    of its users' (0, 0 where it is not found)."""
    dev = os.stat(directory).st_dev
    major, minor = os.major(dev), os.minor(dev)
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if int(f[0]) == major and int(f[1]) == minor:
            return int(f[5]) * 512, int(f[9]) * 512
    return 0, 0


def measured(model: Path, nvme: Path, seq: int, workers: int, steps: int) -> dict:
    """Seconds of each step of the run with the moments on `nvme` (to its updates' end), the device's bytes read and
    written during each (every process's), and the load averages."""
    import torch

    import megatrain
    from megatrain.io.checkpoint import read_hf_config

    config = read_hf_config(model)  # a config, not the directory: the run starts from random weights
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    times, loads, losses, disk = [], [], [], []
    with megatrain.Engine(config, precision="fp32", device="cpu", optimizer_workers=workers, batch_size=1,
                          seq_len=seq, max_grad_norm=1.0, nvme=str(nvme), nvme_states="moments",
                          metrics=False) as engine:
        for _ in range(steps):
            t0, io0 = time.perf_counter(), disk_bytes(nvme)
            losses.append(engine.step(ids))
            engine.wait_for_updates()
            times.append(time.perf_counter() - t0)
            io1 = disk_bytes(nvme)
            disk.append([(b - a) / 2**30 for a, b in zip(io0, io1, strict=True)])
            loads.append(os.getloadavg()[0])
    return {"step_s": times, "load_1min": loads, "losses": losses, "disk_gib_read_written": disk,
            "measured_step_s": sum(times[1:]) / max(1, len(times) - 1),
            "measured_median_step_s": statistics.median(times[1:] or times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme", required=True, type=Path, help="a directory on the disk (ext4, xfs, ...)")
    p.add_argument("--nvme-gib", type=float, default=4.0, help="the disk calibration's bytes each way")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--workers", type=int, default=1, help="optimizer workers (the cores are shared with compute)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work", type=Path, help="where the calibrations and the config go (default: a temporary "
                   "directory, removed)")
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="megatrain-nvme-step-"))
    os.environ["MEGATRAIN_CALIBRATION"] = str(work / "calibration.json")
    os.environ["MEGATRAIN_NVME_RATES"] = str(work / "nvme-rates.json")
    try:
        from megatrain.perf.disk_rates import calibrate_disk

        load = os.getloadavg()[0]
        disk = calibrate_disk(args.nvme, int(args.nvme_gib * 2**30))
        model = model_dir(work, args.hidden, args.layers, args.ffn)
        plan = planned(model, args.nvme, args.seq, args.workers)
        run = measured(model, args.nvme, args.seq, args.workers, args.steps)
        ratio = run["measured_step_s"] / plan["predicted_with_disk_s"]
        median_ratio = run["measured_median_step_s"] / plan["predicted_with_disk_s"]
        result = {"disk": disk, "load_1min_at_start": load, **plan, **run, "measured_vs_predicted": ratio,
                  "median_vs_predicted": median_ratio,
                  "args": {k: str(v) for k, v in vars(args).items()}}
        print(f"disk {args.nvme}: read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s "
              f"(load {load:.1f})")
        print(f"model {plan['params'] / 1e9:.2f} G params, 1 x {args.seq} tokens, moments on NVMe "
              f"({plan['nvme_gib_per_step']:.2f} GiB of disk traffic a step, {plan['host_bytes_per_param']:.1f} B "
              "per parameter in host memory)")
        print(f"predicted: {plan['predicted_with_disk_s']:.2f} s a step with the disk as a bound (disk "
              f"{plan['disk_s']:.2f} s, without it {plan['predicted_step_s']:.2f} s)")
        print(f"measured: {run['measured_step_s']:.2f} s a step (steps {', '.join(f'{t:.2f}' for t in run['step_s'])}"
              f" s; load {', '.join(f'{x:.1f}' for x in run['load_1min'])}): {100 * (ratio - 1):+.0f}%; the median "
              f"(steps 2-) {run['measured_median_step_s']:.2f} s: {100 * (median_ratio - 1):+.0f}%")
        print("the disk during each step (every process's): " + ", ".join(
            f"{r:.2f} GiB read, {w:.2f} written" for r, w in run["disk_gib_read_written"]))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
