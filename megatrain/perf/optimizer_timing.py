"""Timing the optimizer as a run has it: the CPU pool of N worker processes on one shared arena (the workers' own code),
alone and while host-memory copies run beside it (in a run they share the host's memory bandwidth), the rollback
pass, and the resident units' fused AdamW on the GPU. `time_optimizer` is calibration's entry point.

    rates = pool_rates(config, OptimConfig(), (1, 2, 4, 8), repeats=2, copies=CopyLoad("cuda", 2**28), cores=16)
    rates[8].alone, rates[8].beside, rates[8].rollback, rates[8].copies_gbps   # G params/s, GB/s

The workers' processes, the copies on a GPU and on the CPU: docs/design.md#optimizer-timing."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import torch

from megatrain.config import MegatrainError, ModelConfig, OptimConfig
from megatrain.engine.optimizer import AdamWShard
from megatrain.memory.arena import BF16_COPY_SEGMENT, Arena
from megatrain.model.layout import ModelLayout

SIMULATED_PCIE_GBPS = 2 * 55.0  # host memory traffic of a registered arena's H2D and D2H at once (DESIGN.md facts)
CLIP_COEF = 0.5  # the rollback rounds' clip coefficient (its value does not change the pass's cost)


@dataclass
class PoolRate:
    """G params/s of the whole arena's update by one pool size."""

    alone: float
    beside: float  # while the copies ran
    rollback: float  # the rollback pass (roll back + clipped redo), while the copies ran
    copies_gbps: float  # the copies' host memory traffic while they ran (read + written, 10^9 B/s)


class CopyLoad:
    """Copies beside the pool's update: H2D + D2H on a GPU, a paced host memcpy on the CPU
    (docs/design.md#optimizer-timing)."""

    def __init__(self, device: str, nbytes: int, gbps: float | None = None):
        """nbytes: each direction's buffer; gbps: pace to this much host memory traffic (None: as fast as it goes;
        the CPU path defaults to SIMULATED_PCIE_GBPS)."""
        self.on_gpu = device.startswith("cuda")
        self.gbps = gbps if gbps is not None or self.on_gpu else SIMULATED_PCIE_GBPS
        n = max(1, nbytes // 4)
        self.src = torch.ones(n, pin_memory=self.on_gpu)
        self.dst = torch.empty(n, pin_memory=self.on_gpu)
        if self.on_gpu:
            self.dev_in, self.dev_out = torch.empty(n, device=device), torch.ones(n, device=device)
            self.streams = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.moved = 0  # host memory bytes read or written by the copies in the last `running`
        self.seconds = 0.0

    @property
    def kind(self) -> str:
        return "PCIe H2D + D2H" if self.on_gpu else "host memcpy (the CPU path's simulation of PCIe copies)"

    @property
    def achieved_gbps(self) -> float:
        return self.moved / self.seconds / 1e9 if self.seconds else 0.0

    def _once(self) -> int:
        """One round of copies; the host memory bytes it moved."""
        if self.on_gpu:
            with torch.cuda.stream(self.streams[0]):
                self.dev_in.copy_(self.src, non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.dst.copy_(self.dev_out, non_blocking=True)
            for s in self.streams:
                s.synchronize()
            return 2 * self.src.numel() * 4  # one buffer read over PCIe, one written
        self.dst.numpy()[:] = self.src.numpy()  # one core's memcpy (numpy's releases the GIL)
        return 2 * self.src.numel() * 4  # read and written

    @contextmanager
    def running(self) -> Iterator[CopyLoad]:
        """The copies run on a thread of their own until the block ends."""
        stop = threading.Event()
        self.moved, t0 = 0, time.perf_counter()

        def loop() -> None:
            while not stop.is_set():
                self.moved += self._once()
                if self.gbps:  # ahead of the pace: wait for it
                    ahead = self.moved / (self.gbps * 1e9) - (time.perf_counter() - t0)
                    if ahead > 0:
                        stop.wait(ahead)

        thread = threading.Thread(target=loop, name="calibration-copies", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.seconds = time.perf_counter() - t0


def time_optimizer(device: str, config: ModelConfig, cores: int, precision: str, max_workers: int,
                   repeats: int = 2) -> dict[str, Any]:
    """Calibration's optimizer fields (megatrain/perf/calibrate.py, Calibration): the pool of 1 .. max_workers
    workers over an arena laid out like `config` (the pass of a `precision` run: bf16 ones write the bf16 copy), alone,
    beside the copies and its rollback; on a GPU the device's fused AdamW. The copies' buffers are the size of the
    arena's weights, at most 256 MiB each."""
    copies = CopyLoad(device, min(256 * 2**20, 4 * ModelLayout.build(config).numel))
    rates = pool_rates(config, OptimConfig(), tuple(range(1, max_workers + 1)), repeats, copies, cores,
                       bf16_copy=precision == "bf16")
    gparams = {name: {str(w): getattr(r, name) for w, r in rates.items()} for name in ("alone", "beside", "rollback")}
    return {"adamw_gparams": gparams["alone"], "adamw_beside_copies_gparams": gparams["beside"],
            "rollback_gparams": gparams["rollback"], "copies_gbps": min(r.copies_gbps for r in rates.values()),
            "copies_kind": copies.kind,
            "device_adamw_gparams": device_adamw_gparams(device, config) if device.startswith("cuda") else None}


def device_adamw_gparams(device: str, config: ModelConfig, repeats: int = 3) -> float:
    """G params/s of torch's fused AdamW over `config`'s parameters in one flat tensor on the GPU: the resident
    units' update (megatrain/engine/resident.py runs the workers' pass there)."""
    n = ModelLayout.build(config).numel
    p, g, m, v = (torch.full((n,), 1e-3, device=device) for _ in range(4))
    step = torch.tensor(1.0, device=device)
    best = float("inf")
    for i in range(repeats + 1):  # the first untimed
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)
        torch.cuda.synchronize(device)
        best = best if i == 0 else min(best, time.perf_counter() - t0)
    return n / best / 1e9


def pool_rates(config: ModelConfig, optim: OptimConfig, workers: tuple[int, ...], repeats: int, copies: CopyLoad,
               cores: int, bf16_copy: bool = False) -> dict[int, PoolRate]:
    """Each pool size's rates over an arena laid out like `config` (with a bf16 copy where `bf16_copy`: the pass of a
    bf16 run), each worker with cores // N threads, as the engine's workers have. A round's time is the pool's: from
    the first worker told to start to the last one done, as a step waits for the last."""
    layout = ModelLayout.build(config)
    extra = ((BF16_COPY_SEGMENT, "bfloat16", layout.numel),) if bf16_copy else ()
    arena = Arena.create(layout.numel, extra_segments=extra)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        torch.manual_seed(0)
        arena.params.normal_(0.0, 0.02)
        arena.grads.normal_(0.0, 1e-3)
        # each worker sets its thread count per pool size; its threads wait passively at the end of a parallel
        # region, giving the core to one not yet done: where threads outnumber free cores (the CPU path's copies
        # take one) spinning ones made a 2-core machine's rollback pass 10-300x slower
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=env) for _ in range(max(workers))]
        _tell(procs, ("open", arena.handle, config, optim))
        step = 0

        def rounds(command: str, pool: list[subprocess.Popen[bytes]]) -> list[float]:
            nonlocal step
            times = []
            for _ in range(repeats):
                if command == "rollback":  # updated beside a backward (untimed), then the step clipped
                    _tell(pool, ("speculate", step))
                t0 = time.perf_counter()
                _tell(pool, (command, step))
                times.append(time.perf_counter() - t0)
                step += 1
            return times

        rates: dict[int, PoolRate] = {}
        for w in workers:
            pool = procs[:w]
            for i, proc in enumerate(pool):
                _send(proc, ("shard", i, w, max(1, cores // w)))
            _replies(pool)
            rounds("update", pool)  # untimed: first touch of the shard's pages and moments
            alone = rounds("update", pool)
            with copies.running():
                beside, rollback = rounds("update", pool), rounds("rollback", pool)
            rates[w] = PoolRate(*(layout.numel / min(t) / 1e9 for t in (alone, beside, rollback)),
                                copies.achieved_gbps)
        for proc in procs:
            _send(proc, ("quit",))
        return rates
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=10)  # told to quit; one that was not (a failure) is killed
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        arena.destroy()


def _send(proc: subprocess.Popen[bytes], message: tuple[Any, ...]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(message).hex().encode() + b"\n")
    proc.stdin.flush()


def _replies(procs: list[subprocess.Popen[bytes]]) -> None:
    """Waits for each worker's answer to what it was told last."""
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if line != "ok":
            raise MegatrainError(f"a calibration optimizer worker failed ({line or f'exit code {proc.wait()}'}); "
                                 "its traceback is above.")


def _tell(procs: list[subprocess.Popen[bytes]], message: tuple[Any, ...]) -> None:
    for proc in procs:
        _send(proc, message)
    _replies(procs)


def _serve(commands: IO[str], replies: IO[str]) -> None:
    """A worker process: `open` maps the arena; `shard` makes it worker i of N with its threads; `update`,
    `speculate` and `rollback` (AdamWShard.settle of a speculated update with a clip) walk every unit of its shard
    in forward order; each answered with a line "ok"."""
    arena, shard, config, optim = None, None, None, None
    for line in commands:
        command, *args = pickle.loads(bytes.fromhex(line.strip()))
        if command == "quit":
            break
        if command == "open":
            handle, config, optim = args
            arena = Arena.open(handle)
        elif command == "shard":
            worker, workers, threads = args
            torch.set_num_threads(threads)
            assert arena is not None and config is not None and optim is not None
            shard = AdamWShard(ModelLayout.build(config), arena.tensors, optim, worker, workers)
        else:
            assert shard is not None
            step = args[0]
            for unit in range(len(shard.layout.units)):
                if command == "update":
                    shard.update(unit, step)
                elif command == "speculate":
                    shard.speculate(unit, step, speculation=step)
                else:
                    shard.settle(unit, step, CLIP_COEF, speculation=step)
        replies.write("ok\n")
        replies.flush()
    if arena is not None:
        arena.close()


if __name__ == "__main__":
    _serve(sys.stdin, sys.stdout)
