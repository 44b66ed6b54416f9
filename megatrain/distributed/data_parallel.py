"""Data parallelism between executors: each runs its share of a step's rows, and every unit's gradient is summed
over them before it leaves the device, each executor writing only its 1/N slice of the sum into the arena.

The process group (gloo on the CPU path, NCCL between GPUs) is made inside the executor actors; model math knows
nothing of it (docs/design.md#data-parallelism)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatrain.distributed.process_group import join_process_group, leave_process_group
from megatrain.model.layout import ALIGN, aligned_split


@dataclass
class DataParallel:
    rank: int
    world: int
    device: torch.device  # where the collectives' tensors live (NCCL's on the GPU)

    @classmethod
    def join(cls, rank: int, world: int, address: str, device: torch.device, timeout_s: float = 120.0
             ) -> DataParallel:
        """Joins the process group of `world` executors at `address` (tcp://host:port) as `rank`."""
        join_process_group("nccl" if device.type == "cuda" else "gloo", address, rank, world, timeout_s,
                           lambda e: f"executor {rank} of {world} could not join the others at {address} ({e}); "
                                     "check that every executor started (the Ray dashboard shows why one did not).")
        return cls(rank, world, device)

    def rows(self, total: int) -> slice:
        """This rank's rows of a step's `total` (which the engine checked divide evenly)."""
        per = total // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def shard(self, numel: int) -> slice:
        """This rank's slice of a unit's `numel` gradient elements, cut on ALIGN boundaries: with several nodes the
        slices of a node's ranks (consecutive) make up the part of the unit that node's optimizer updates."""
        return slice(*aligned_split(numel, self.rank, self.world))

    def reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `flat` (one unit's gradient, fp32), this rank's shard of it."""
        mine = self.shard(flat.numel())
        if flat.is_cuda and flat.numel() // ALIGN % self.world == 0:  # NCCL (equal shards): each gets only its own
            out = torch.empty(flat.numel() // self.world, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter_tensor(out, flat)
            return out
        dist.all_reduce(flat)  # gloo has no reduce-scatter
        return flat[mine]

    def all_finite(self, value: float) -> bool:
        """Whether `value` is finite on every rank: all go on to the backward (and its collectives) or none does."""
        bad = torch.tensor([0.0 if math.isfinite(value) else 1.0], device=self.device)
        dist.all_reduce(bad)
        return bool(bad.item() == 0.0)

    def close(self) -> None:
        leave_process_group()
