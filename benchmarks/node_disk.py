"""Each node's NVMe bytes a step in a run on two nodes with states on NVMe, against the memory plan's count of them.

    python3 benchmarks/node_disk.py --work /path/on/disk --out node_disk.json

Two Ray nodes on this machine (ray.cluster_utils; each its own arena directory under --work, the state files in
--work/nvme), one executor and one optimizer worker each, bf16 with the copy streamed, --states on NVMe, the serial
update (the plan counts each held gradient written as it lands and read back). After a first step, --steps more: the
storage layer's bytes (/proc/PID/io read_bytes, write_bytes: /dev/shm is tmpfs and counts none) of each node's store
(the masters' exchange) and worker (its part of every state), per streamed parameter a step, beside the plan's
TierPlan.read_bytes and write_bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def io_bytes(pid: int) -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def measure(work: Path, model: str, states: str, steps: int) -> dict:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    import megatrain

    shm, nvme = [work / "shm0", work / "shm1"], work / "nvme"
    for d in (*shm, nvme):
        d.mkdir(parents=True, exist_ok=True)
    args = dict(num_cpus=2, object_store_memory=100 * 2**20)
    nodes = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False,
                                                          "env_vars": {"MEGATRAIN_SHM_DIR": str(shm[0])}})
    nodes.add_node(**args, env_vars={"MEGATRAIN_SHM_DIR": str(shm[1])})
    try:
        ray.init(address=nodes.address)
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(steps + 1)]
        with megatrain.Engine(model, batch_size=4, seq_len=32, device="cpu", optimizer_workers=1, nodes=2,
                              executors=1, precision="bf16", bf16_copy="keep", speculate="off", nvme=str(nvme),
                              nvme_states=states) as engine:
            engine.step(batches[0])
            engine.wait_for_updates()
            pids = [[ray.get(a.pid.remote()) for a in (engine.stores[m], engine.workers[m])] for m in range(2)]
            before = [[io_bytes(p) for p in node] for node in pids]
            for ids in batches[1:]:
                engine.step(ids)
            engine.wait_for_updates()
            after = [[io_bytes(p) for p in node] for node in pids]
            tier, numel = engine.plan.tier, engine.actors.layout.numel
    finally:
        ray.shutdown()
        nodes.shutdown()
    out = {"model": model, "states": states, "steps": steps, "streamed_params": numel,
           "planned_per_param": [tier.read_bytes / numel, tier.write_bytes / numel]}
    for m in range(2):
        for role, b, a in zip(("store", "worker"), before[m], after[m], strict=True):
            out[f"node{m}_{role}_per_param"] = [(a[i] - b[i]) / steps / numel for i in (0, 1)]
        out[f"node{m}_per_param"] = [sum(out[f"node{m}_{r}_per_param"][i] for r in ("store", "worker"))
                                     for i in (0, 1)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="a directory on a local disk (default: a new one under /tmp)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--states", default="all", help="nvme_states of the run (default all: masters, moments, grads)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    ray_dir = tempfile.mkdtemp(prefix="mt", dir="/tmp")  # a Ray of its own (its sockets' paths must be short)
    os.environ["RAY_TMPDIR"] = ray_dir
    try:
        with tempfile.TemporaryDirectory(dir=a.work or "/tmp") as work:
            out = measure(Path(work), a.model, a.states, a.steps)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    read, written = out["planned_per_param"]
    print(f"{a.model}, nvme_states {a.states}, 2 nodes: planned {read:.2f} B read, {written:.2f} B written a "
          "parameter a step per node")
    for m in range(2):
        r, w = out[f"node{m}_per_param"]
        print(f"node {m}: {r:.2f} B read, {w:.2f} B written (store {out[f'node{m}_store_per_param'][0]:.2f} / "
              f"{out[f'node{m}_store_per_param'][1]:.2f}, worker {out[f'node{m}_worker_per_param'][0]:.2f} / "
              f"{out[f'node{m}_worker_per_param'][1]:.2f})")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
