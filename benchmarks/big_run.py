"""A model past this machine's memory trains with the NVMe tier: issue #44's "training state at 16 bytes per parameter
at least 1.5x the machine's memory" run, on the CPU path.

    python3 benchmarks/big_run.py --nvme /path/on/disk --out big_run.json

The model is the 1b preset's layer (width 2048, FFN 8192, GQA 32/8 heads) with a byte vocabulary, as many layers as
make 16 bytes a parameter at least --times (1.5) x MemTotal; fp32, clipping on (max_grad_norm 1), the Adam moments
and the held gradients on --nvme, 1 x --seq tokens a step (little compute: the disk bounds the step). While it runs
a thread samples, every --every seconds, the run's process tree (this process and every descendant: Ray's daemons,
the actors) and /dev/shm: the tree's proportional resident memory less its /dev/shm pages (smaps_rollup Pss -
Pss_Shmem) plus everything /dev/shm holds (statvfs; other processes' segments too: an upper bound). Afterwards it
lists what the run left in /dev/shm and in --nvme. Prints a summary and, with --out, the numbers as JSON
(tests/test_big_run.py runs it and checks them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 2**30


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def big_config(times: float, memory: int):
    """The model: the 1b preset's layer, a byte vocabulary, enough layers that 16 B a parameter >= times x memory."""
    from megatrain.config import ModelConfig

    base = replace(ModelConfig.from_name("1b"), intermediate_size=8192, vocab_size=256)
    rest = base.num_params() - base.num_layers * base.layer_params()  # embedding, head, final norm
    layers = math.ceil((times * memory / 16 - rest) / base.layer_params())
    return replace(base, num_layers=layers)


def _rollup(pid: int) -> tuple[int, int]:
    """(Pss, Pss_Shmem) bytes of a process (0, 0 where it is gone)."""
    pss = shmem = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
            elif line.startswith("Pss_Shmem:"):
                shmem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, shmem


class Sampler(threading.Thread):
    """Samples the process tree's memory and /dev/shm's use every `every` seconds until stopped."""

    def __init__(self, every: float):
        super().__init__(daemon=True)
        self.every, self.samples = every, []
        self.pids: set[int] = set()  # every process of the tree seen (whose /dev/shm segments are the run's)
        self.done = threading.Event()

    def sample(self) -> dict[str, float]:
        import psutil

        me = psutil.Process()
        pids = [me.pid] + [p.pid for p in me.children(recursive=True)]
        self.pids.update(pids)
        rollups = [_rollup(pid) for pid in pids]
        st = os.statvfs("/dev/shm")
        shm = (st.f_blocks - st.f_bfree) * st.f_frsize
        private = sum(pss - shmem for pss, shmem in rollups)
        return {"t": time.time(), "processes": len(pids), "tree_gib": private / GiB, "shm_gib": shm / GiB,
                "total_gib": (private + shm) / GiB}

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(self.sample())
            self.done.wait(self.every)

    def stop(self) -> list[dict[str, float]]:
        self.done.set()
        self.join()
        return self.samples


def train(config, nvme: Path, steps: int, seq: int, workers: int, lr: float) -> tuple[list[float], list[float], dict]:
    """(losses, step seconds, the run plan's memory numbers) of `steps` steps on one fixed batch."""
    import torch

    import megatrain

    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    losses, times = [], []
    with megatrain.Engine(config, precision="fp32", device="cpu", optimizer_workers=workers, batch_size=1,
                          seq_len=seq, max_grad_norm=1.0, lr=lr, warmup_steps=0, nvme=str(nvme),
                          nvme_states="moments,grads", metrics=False) as engine:
        plan = engine.run_plan.memory
        planned = {"host_total_gib": plan.host_total / GiB, "arena_host_gib": plan.arena_host_bytes / GiB,
                   "nvme_gib": plan.tier.nvme_bytes / GiB, "tier": list(plan.tier.names)}
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(engine.step(ids))
            engine.wait_for_updates()
            times.append(time.perf_counter() - t0)
    return losses, times, planned


def left_behind(nvme: Path, pids: set[int]) -> dict[str, list[str]]:
    """What the run left: arena segments in /dev/shm owned by its processes, anything under --nvme."""
    from megatrain.memory.arena import list_segments

    shm = [str(p) for p in list_segments() if any(f"-{pid}-" in p.name for pid in pids)]
    return {"shm": shm, "nvme": sorted(str(p) for p in nvme.iterdir())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme", required=True, type=Path, help="a directory on a local disk (ext4, xfs, ...)")
    p.add_argument("--times", type=float, default=1.5, help="16 B a parameter as a multiple of MemTotal")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--workers", type=int, default=1, help="optimizer workers")
    # no warm-up: the loss falls from the first step. Adam's first step moves every weight by lr; at 1e-4 and 2e-5 the
    # 2.4 G model fits its one batch in that step (6.35 -> 1.03, -> 0.12) and the momentum overshoots in the next
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--every", type=float, default=1.0, help="seconds between memory samples")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    memory = mem_total()
    config = big_config(args.times, memory)
    sampler = Sampler(args.every)
    sampler.start()
    t0, load = time.time(), os.getloadavg()
    try:
        losses, times, planned = train(config, args.nvme, args.steps, args.seq, args.workers, args.lr)
    finally:
        samples = sampler.stop()
    peak = max(samples, key=lambda s: s["total_gib"])
    result = {"params": config.num_params(), "layers": config.num_layers, "state_16b_gib": 16 * config.num_params()
              / GiB, "mem_total_gib": memory / GiB, "losses": losses, "step_s": times, "wall_s": time.time() - t0,
              "load_at_start": load, "load_at_end": os.getloadavg(), "peak": peak, "planned": planned,
              "left": left_behind(args.nvme, sampler.pids), "samples": samples}
    print(f"{config.num_params() / 1e9:.2f} G params ({config.num_layers} layers): {result['state_16b_gib']:.1f} GiB "
          f"at 16 B a parameter, {result['state_16b_gib'] * GiB / memory:.2f} x MemTotal {memory / GiB:.1f} GiB")
    print(f"losses {', '.join(f'{x:.4f}' for x in losses)}; steps {', '.join(f'{t:.1f}' for t in times)} s; "
          f"load {load[0]:.1f} -> {result['load_at_end'][0]:.1f}")
    print(f"peak: process tree {peak['tree_gib']:.2f} GiB + /dev/shm {peak['shm_gib']:.2f} GiB = "
          f"{peak['total_gib']:.2f} GiB ({peak['processes']} processes); planned host total "
          f"{planned['host_total_gib']:.2f} GiB, {planned['nvme_gib']:.1f} GiB on NVMe ({', '.join(planned['tier'])})")
    print(f"left behind: /dev/shm {result['left']['shm'] or 'nothing'}, NVMe {result['left']['nvme'] or 'nothing'}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
