"""The NVMe tier against its disk, in one run: the directory's raw sequential GB/s, the tier's own I/O, and a training
step bound by the disk against what the plan predicts.

    python3 benchmarks/nvme.py --nvme /path/on/nvme --gib 4 --model 0.1b --steps 3 --out nvme.json

1. raw: one file of --gib GiB written then read in 64 MiB requests by one thread with O_DIRECT (what `dd bs=64M
   oflag=direct` / `iflag=direct` does), the disk's plain sequential rate with no page cache;
2. tier: the same bytes moved the tier's way: state files (megatrain/memory/nvme.py StateFiles, 4 MiB requests from 4
   threads) staged unit by unit through slots of a /dev/shm mapping as an optimizer worker does
   (megatrain/memory/staging.py UnitStager: read ahead, write behind): a pass reading and writing each unit, then one
   only reading; the write rate is the first pass's time less the second's. Reported as a share of raw (target
   >= 80%);
3. step: an Engine with the Adam moments on --nvme (`--model`, fp32, clipping on, the update beside the backward) and
   the same run with every state in host memory; the prediction is the plan's: the step with the disk as a bound,
   max(step without the tier, the tier's disk seconds at the rates of 2.), the step without the tier taken as the
   host-memory run measures it (the CPU path has no calibrated compute prediction unless `megatrain calibrate` ran),
   within 25% of the measured NVMe step as the target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatrain.memory.nvme import StateFiles, _bytes, aligned_buffer, check_directory  # noqa: E402
from megatrain.memory.staging import UnitStager, unit_extents  # noqa: E402

RAW_BLOCK = 64 << 20
UNIT_BYTES = 64 << 20  # one staged unit's share: a 7B layer's moments per worker of 8 are ~100 MiB


def raw_rates(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) GB/s of one thread's sequential O_DIRECT requests of RAW_BLOCK bytes."""
    path = directory / f".megatrain-raw-{uuid.uuid4().hex[:6]}"
    buf = aligned_buffer(RAW_BLOCK)
    buf.random_(0, 255)
    view = _bytes(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        rates = []
        for io in (os.pwritev, os.preadv):
            t0 = time.perf_counter()
            for at in range(0, nbytes, RAW_BLOCK):
                io(fd, [view], at)
            os.fsync(fd)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        return rates[0], rates[1]
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def tier_rates(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) GB/s of the tier moving `nbytes` between state files and /dev/shm unit by unit, as an optimizer
    worker does: each unit through its staging slot (megatrain/memory/staging.py SLOTS), read ahead of the one taken,
    written behind it."""
    from megatrain.memory.staging import SLOTS, STAGE_PREFIX

    units = max(1, nbytes // UNIT_BYTES)
    per = UNIT_BYTES // 4
    shm = Path("/dev/shm") / f"megatrain-bench-nvme-{uuid.uuid4().hex[:6]}"
    with open(shm, "wb") as f:
        f.truncate(SLOTS * UNIT_BYTES)
    files = StateFiles.create(directory, {"exp_avg": units * UNIT_BYTES})
    try:
        slots = torch.from_file(str(shm), shared=True, size=SLOTS * per, dtype=torch.float32)
        slots.fill_(1.0)  # the slots' pages, allocated once as the arena's staging segments are
        stager = UnitStager(files, {STAGE_PREFIX + "exp_avg": slots}, None,
                            unit_extents({u: (u * per, (u + 1) * per) for u in range(units)}, ("exp_avg",)),
                            slot_numel=per)
        t0 = time.perf_counter()
        for u in range(units):  # every unit written behind from its slot
            stager.give(u)
        stager.flush()
        write = units * UNIT_BYTES / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for u in range(units):  # every unit read into its slot, the next one ahead of it
            stager.take(u)
            stager.give(u, changed=False)
        stager.flush()
        read = units * UNIT_BYTES / (time.perf_counter() - t0) / 1e9
        stager.close()
        return write, read
    finally:
        files.unlink()
        shm.unlink(missing_ok=True)


def step_times(directory: Path, model: str, steps: int, seq: int) -> dict[str, float]:
    """Mean step seconds (after the first) with the moments on NVMe and in host memory, and the plan's prediction
    of the NVMe step from the host run's and the tier's disk seconds."""
    import megatrain
    from megatrain.memory.tier_plan import with_tier
    from megatrain.perf.disk_rates import disk_rates

    out: dict[str, float] = {}
    ids = torch.randint(0, 256, (1, seq))
    for name, extra in (("host", {}), ("nvme", {"nvme": str(directory), "nvme_states": "moments"})):
        with megatrain.Engine(model, precision="fp32", device="cpu", optimizer_workers=1, batch_size=1, seq_len=seq,
                              max_grad_norm=1.0, speculate="on", metrics=False, **extra) as engine:
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step(ids)
                engine.wait_for_updates()
                times.append(time.perf_counter() - t0)
            out[f"{name}_step_s"] = sum(times[1:]) / max(1, len(times) - 1)
            if name == "nvme":
                plan = with_tier(engine.plan, engine.config, str(directory), "moments", disk_rates(directory))
                out["disk_s"] = plan.tier.seconds() or 0.0
                out["nvme_gib_per_step"] = (plan.tier.read_bytes + plan.tier.write_bytes) / 2**30
    out["predicted_nvme_step_s"] = max(out["host_step_s"], out["disk_s"])
    out["step_vs_prediction"] = out["nvme_step_s"] / out["predicted_nvme_step_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme", required=True, help="a directory on the disk to measure")
    p.add_argument("--gib", type=float, default=4.0, help="bytes moved each way (default 4 GiB)")
    p.add_argument("--model", help="also a disk-bound training step of this preset (e.g. 0.1b)")
    p.add_argument("--repeats", type=int, default=3, help="measurements of each, the best reported (default 3)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--out", help="write the numbers as JSON here")
    args = p.parse_args(argv)
    directory = Path(args.nvme)
    nbytes = int(args.gib * 2**30) // RAW_BLOCK * RAW_BLOCK or RAW_BLOCK
    disk = check_directory(directory, 2 * nbytes)
    raws, tiers = [], []
    for _ in range(args.repeats):  # interleaved: a shared or virtual disk's rate drifts between measurements
        raws.append(raw_rates(directory, nbytes))
        tiers.append(tier_rates(directory, nbytes))
    (raw_w, raw_r), (tier_w, tier_r) = (tuple(max(r[i] for r in rs) for i in (0, 1)) for rs in (raws, tiers))
    result = {"directory": str(directory), "fs": disk.fs_type, "bytes": nbytes, "raw_write_gbps": raw_w,
              "raw_read_gbps": raw_r, "tier_write_gbps": tier_w, "tier_read_gbps": tier_r,
              "tier_write_share": tier_w / raw_w, "tier_read_share": tier_r / raw_r, "all_raw": raws,
              "all_tier": tiers}
    print(f"{directory} ({disk.fs_type}), {nbytes / 2**30:.1f} GiB each way, best of {args.repeats}")
    print(f"  raw (1 thread, 64 MiB O_DIRECT): write {raw_w:.2f} GB/s, read {raw_r:.2f} GB/s")
    print(f"  tier (state files staged through /dev/shm): write {tier_w:.2f} GB/s ({100 * tier_w / raw_w:.0f}% of "
          f"raw), read {tier_r:.2f} GB/s ({100 * tier_r / raw_r:.0f}% of raw)")
    if args.model:
        from megatrain.perf.disk_rates import calibrate_disk

        calibrate_disk(directory, nbytes)  # the rates the plan predicts from, measured now
        steps = step_times(directory, args.model, args.steps, args.seq)
        result.update(steps)
        print(f"  step ({args.model}, moments on NVMe, {steps['nvme_gib_per_step']:.2f} GiB of disk traffic): "
              f"measured {steps['nvme_step_s']:.2f} s, predicted {steps['predicted_nvme_step_s']:.2f} s "
              f"(host-memory step {steps['host_step_s']:.2f} s, disk {steps['disk_s']:.2f} s): "
              f"{100 * (steps['step_vs_prediction'] - 1):+.0f}%")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
