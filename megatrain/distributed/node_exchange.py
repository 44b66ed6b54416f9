"""Several nodes: keeping every node's copy of the weights equal after each update.

Each node's optimizer updates its part of every unit; the stores (gloo over TCP) then broadcast every node's part to
the others, unit by unit in forward order as the local workers finish it, and mark the version table's sync column,
so the next forward starts while later units are still being sent (docs/design.md#the-weight-exchange)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatrain.config import MegatrainError
from megatrain.distributed.process_group import join_process_group, leave_process_group
from megatrain.memory.versions import VersionTable
from megatrain.model.layout import ModelLayout, NodeShard, aligned_split


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
                     shadow: torch.Tensor | None = None) -> None:
        """After update `step` (0-based): every node's part of each unit broadcast to the others (see the module
        doc). versions: [units, workers + 1], the last column written here."""
        nodes, me = self.shard.nodes, self.shard.node
        table = VersionTable(versions)
        for unit in layout.units:
            self._wait_updated(table, step + 1, unit.index)
            for owner in range(nodes):
                lo, hi = aligned_split(unit.numel, owner, nodes)
                part = params[unit.offset + lo : unit.offset + hi]
                if part.numel():
                    dist.broadcast(part, src=owner)
                if owner != me and shadow is not None:  # the owner's workers rounded their own part
                    shadow[unit.offset + lo : unit.offset + hi].copy_(part)
            table.set(unit.index, -1, step + 1)

    def _wait_updated(self, table: VersionTable, version: int, unit: int) -> None:
        """Until this node's workers (every column but the last) applied update `version` to `unit`."""
        if not table.wait(unit, version, columns=slice(None, -1), timeout=self.timeout_s):
            raise MegatrainError(f"node {self.shard.node}'s optimizer workers did not apply update {version} "
                                 f"to unit {unit} within {self.timeout_s:g} s; check the Ray dashboard for a "
                                 "dead or stuck optimizer worker.")

    def close(self) -> None:
        leave_process_group()
