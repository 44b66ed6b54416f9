"""Several nodes: keeping every node's copy of the weights equal after each update.

Each node's optimizer updates its part of every unit; the stores (gloo over TCP) then broadcast every node's part to
the others, unit by unit in forward order as the local workers finish it, and mark the version table's sync column,
so the next forward starts while later units are still being sent (docs/design.md#the-weight-exchange)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatrain.config import MegatrainError
from megatrain.distributed.process_group import join_process_group, leave_process_group
from megatrain.memory.nvme import StateFiles, aligned_buffer
from megatrain.memory.versions import VersionTable
from megatrain.model.layout import ALIGN, ModelLayout, NodeShard, aligned_split

PART_NUMEL = 8192 * ALIGN  # elements (32 MiB of fp32) a tiered part crosses in at a time: 4 such buffers per store


class MasterParts:
    """The exchange where the fp32 masters are on NVMe (megatrain/memory/nvme.py): each node's state file holds the
    whole masters, as on one node, so checkpoints, exports and Engine.parameters read any node's. The owner reads its
    updated part of a unit back from its file (its workers publish a unit's version once its write is on disk) and
    broadcasts it; the others write it into their files (direct I/O, behind: done before sync_weights returns) and
    round it into the bf16 copy. Through four aligned buffers of PART_NUMEL elements (two read and two written in
    turn: the next piece moves on disk while one crosses), never a whole unit. Per step and streamed parameter, each of
    M nodes' disks moves for the masters 4/M B read and 4/M written by its workers, 4/M read and 4 (M-1)/M written
    here: 8/M read, 4 written (2 nodes: 4 and 4, as on one)."""

    def __init__(self, files: StateFiles, first: int, largest: int):
        """first: the element of the params segment the units on NVMe start at (the resident units' are in the arena);
        largest: elements of the largest unit (the buffers need no more)."""
        self.files, self.first = files, first
        self.buffers = [_floats(min(PART_NUMEL, largest)) for _ in range(4)]  # 0, 1 read into; 2, 3 written from
        self.pending: list[Future | None] = [None] * 4
        self.turns = [0, 0]  # the read buffer and the written one used last

    def holds(self, at: int) -> bool:
        return at >= self.first

    def read(self, at: int, numel: int) -> int:
        """Starts reading elements [at, at + numel) of the masters (at most PART_NUMEL) into the next read buffer;
        returns it, for `ready`."""
        i = self._next(0)
        self.pending[i] = self.files.read("params", at * 4, self.buffers[i][:numel])
        return i

    def ready(self, i: int, numel: int) -> torch.Tensor:
        """Read buffer `i` once its read is done."""
        self._wait(i)
        return self.buffers[i][:numel]

    def receive(self, numel: int) -> torch.Tensor:
        """The next buffer to receive `numel` elements in, once its last write is on disk."""
        return self.buffers[self._next(1)][:numel]

    def write(self, at: int, part: torch.Tensor) -> None:
        """`part` (the buffer `receive` gave last) into elements [at, ...) of the file, behind."""
        self.pending[2 + self.turns[1]] = self.files.write("params", at * 4, part)

    def flush(self) -> None:
        for i in range(len(self.pending)):
            self._wait(i)

    def _next(self, group: int) -> int:
        self.turns[group] = 1 - self.turns[group]
        i = 2 * group + self.turns[group]
        self._wait(i)
        return i

    def _wait(self, i: int) -> None:
        pending, self.pending[i] = self.pending[i], None
        if pending is not None:
            pending.result()


@dataclass
class NodeGroup:
    """This node's store among the run's M stores (rank = node)."""

    shard: NodeShard
    timeout_s: float

    @classmethod
    def join(cls, shard: NodeShard, address: str, timeout_s: float = 600.0) -> NodeGroup:
        """Joins the stores' process group at `address` (tcp://host:port of node 0's store)."""
        join_process_group("gloo", address, shard.node, shard.nodes, timeout_s,
                           lambda e: f"the parameter store of node {shard.node} of {shard.nodes} could not reach the "
                                     f"others at {address} ({e}); check that the nodes reach each other over TCP "
                                     "(firewall, the address Ray gave node 0).")
        return cls(shard, timeout_s)

    def sync_weights(self, layout: ModelLayout, step: int, params: torch.Tensor, versions: torch.Tensor,
                     bf16_copy: torch.Tensor | None = None, masters: MasterParts | None = None) -> None:
        """After update `step` (0-based): every node's part of each unit broadcast to the others (see the module
        doc). versions: [units, workers + 1], the last column written here. masters: where the fp32 masters are on
        NVMe (the units from masters.first on), their state file's exchange."""
        nodes, me = self.shard.nodes, self.shard.node
        table = VersionTable(versions)
        try:
            for unit in layout.units:
                self._wait_updated(table, step + 1, unit.index)
                for owner in range(nodes):
                    lo, hi = aligned_split(unit.numel, owner, nodes)
                    if masters is not None and masters.holds(unit.offset):
                        self._send_tiered(masters, owner, unit.offset + lo, unit.offset + hi, bf16_copy)
                        continue
                    part = params[unit.offset + lo : unit.offset + hi]
                    if part.numel():
                        dist.broadcast(part, src=owner)
                    if owner != me and bf16_copy is not None:  # the owner's workers rounded their own part
                        bf16_copy[unit.offset + lo : unit.offset + hi].copy_(part)
                table.set(unit.index, -1, step + 1)
        finally:  # the parts received are on disk before anything reads the file (a checkpoint, a later exchange)
            if masters is not None:
                masters.flush()

    def _send_tiered(self, masters: MasterParts, owner: int, start: int, end: int, bf16_copy: torch.Tensor | None
                     ) -> None:
        """Elements [start, end) of the masters, node `owner`'s part of a unit, from its state file to the others'
        (and their bf16 copies), PART_NUMEL elements at a time."""
        pieces = [(at, min(PART_NUMEL, end - at)) for at in range(start, end, PART_NUMEL)]
        if owner == self.shard.node:  # each piece read while the one before crosses
            ahead = masters.read(*pieces[0]) if pieces else None
            for k, (_, numel) in enumerate(pieces):
                now, ahead = ahead, masters.read(*pieces[k + 1]) if k + 1 < len(pieces) else None
                dist.broadcast(masters.ready(now, numel), src=owner)
            return
        for at, numel in pieces:
            part = masters.receive(numel)
            dist.broadcast(part, src=owner)
            masters.write(at, part)
            if bf16_copy is not None:
                bf16_copy[at : at + numel].copy_(part)

    def _wait_updated(self, table: VersionTable, version: int, unit: int) -> None:
        """Until this node's workers (every column but the last) applied update `version` to `unit`."""
        if not table.wait(unit, version, columns=slice(None, -1), timeout=self.timeout_s):
            raise MegatrainError(f"node {self.shard.node}'s optimizer workers did not apply update {version} "
                                 f"to unit {unit} within {self.timeout_s:g} s; check the Ray dashboard for a "
                                 "dead or stuck optimizer worker.")

    def close(self) -> None:
        leave_process_group()


def _floats(numel: int) -> torch.Tensor:
    return aligned_buffer(numel * 4).view(torch.float32)[:numel]
