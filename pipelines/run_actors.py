"""The actors of one run: every node's parameter store, optimizer workers and executors, made in the placements
reserved for them (pipelines/cluster.py), replaced in a recovery, stopped; and how the driver calls them.

Each actor is named megatrain/<run>/<role>#<restarts>: readable in the dashboard and `ray timeline`, and the restart
count keeps a replacement's name free. A path from the user is made absolute before an actor sees it (actors run in
their own working directory), and an actor's megatrain error reaches the caller as itself (`get`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch

from actors.executor import GPUExecutor
from actors.optimizer_worker import OptimizerWorker
from actors.parameter_store import ParameterStoreActor
from megatrain.config import MegatrainError, ModelConfig, OptimConfig, cause_chain
from megatrain.distributed.process_group import free_port
from megatrain.engine.messages import ExecutorStep, merged
from megatrain.engine.optimizer import Speculation
from megatrain.io.checkpoint import check_save_target
from megatrain.lora.layout import training_layout
from megatrain.memory.arena import Arena, ArenaHandle, remove_stale_segments
from megatrain.memory.nvme import StateFiles, TierSpec
from megatrain.memory.staging import TierReader
from megatrain.memory.versions import VersionTable
from megatrain.run_plan import RunPlan
from pipelines.cluster import NodePlacement

log = logging.getLogger(__name__)


def get(refs: Any, timeout: float | None = None) -> Any:
    """ray.get that raises a megatrain error from an actor as itself: one sentence, not Ray's traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = cause_chain(e)[-1]
        if isinstance(cause, MegatrainError):
            raise cause from None
        raise


def absolute(path: str | Path) -> str:
    """Actors run in their own working directory: a path from the user is made absolute on the driver."""
    return os.path.abspath(Path(path).expanduser())


def save_target(path: str | Path) -> str:
    """absolute(path), refused here if the driver could not have it replaced (see check_save_target)."""
    path = absolute(path)
    check_save_target(Path(path))
    return path


class RunActors:
    """The actors of one run, node by node: node m's parameter store, optimizer workers and executors live in
    placement m (the driver's node first)."""

    def __init__(self, run_id: str, config: ModelConfig, optim: OptimConfig, trace: bool, metrics: Any) -> None:
        self.run_id, self.config, self.optim, self.trace, self.metrics = run_id, config, optim, trace, metrics
        # what trains (a LoRA run's adapters; set by start): the workers take it as it is, no model of theirs to build
        self.layout: Any = None
        self.placements: list[NodePlacement] = []  # one per node, the driver's first
        self.stores: list[Any] = []  # one per node, the driver's first
        self.handles: list[ArenaHandle] = []  # their arenas
        self.handle_refs: list[ray.ObjectRef] = []  # the stores' `handle` calls: what workers and executors are given
        self.executors: list[Any] = []  # rank order: the first also evaluates and holds gradients on the device
        self.workers: list[Any] = []
        self.arena: Arena | None = None  # the driver's map of its node's arena: the version table and the weights
        self.versions: VersionTable | None = None
        self.restarts = 0  # actor deaths survived
        # set by start: the run's plan, and what the stores build the model from (again, in a recovery)
        self.plan: RunPlan | None = None
        self.model: str | ModelConfig = ""
        self.adapter: str | None = None

    @property
    def tier(self) -> TierSpec | None:
        """The states on NVMe (megatrain/memory/nvme.py)."""
        return self.plan.tier

    def start(self, plan: RunPlan, model: str | ModelConfig, adapter: str | None) -> None:
        """Every node's actors, in the placements reserved, each given the plan and its rank. model: an HF
        directory's absolute path, a preset name or a config; adapter: the PEFT adapter directory a LoRA run starts
        from."""
        self.plan, self.model, self.adapter = plan, model, adapter
        self.layout = training_layout(self.config, plan.lora)
        self._start()

    def replace_all(self) -> None:
        """Every actor killed and made again in its placement, with new arenas."""
        self.stop(close=False)
        self._start()

    def _start(self) -> None:
        nodes = len(self.placements)
        self.stores = [ParameterStoreActor.options(name=self._name("parameter-store" if nodes == 1 else
                                                                   f"parameter-store/{m}"), **p.pinned()
                                                   ).remote(self.model, self.plan, m, self.run_id, self.adapter)
                       for m, p in enumerate(self.placements)]
        # The workers and executors start while the stores build their arenas (their processes' imports are a second
        # or more each): each gets its node's handle as a reference inside a list, which Ray hands over as it is
        # (a reference passed as an argument itself would hold the actor back until the store is done)
        self.handle_refs = [s.handle.remote() for s in self.stores]
        self.workers = [self.new_worker(w) for w in range(nodes * self.placements[0].workers)]
        self.executors = self.new_executors()
        self.handles = get(self.handle_refs)
        if nodes > 1:  # the stores' own group, to keep the nodes' weights equal (distributed/node_exchange.py)
            address = f"tcp://{get(self.stores[0].node_ip.remote())}:{free_port()}"
            get([s.join_nodes.remote(address) for s in self.stores])
        self.arena = Arena.open(self.handles[0])  # the driver reads the version table and, on request, weights
        self.versions = VersionTable(self.arena.versions.view(-1, self.placements[0].workers + (nodes > 1)))
        get([w.numel.remote() for w in self.workers])  # all up before the first step

    def flush_tier(self) -> list[ray.ObjectRef]:
        """Waits for the workers' writes behind to the NVMe tier (before anything reads the state files); []."""
        if self.tier is not None:
            get([w.flush.remote() for w in self.workers])
        return []

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, a copy of its current fp32 weight) one tensor at a time (a LoRA run's adapters, by PEFT name),
        read where they live: the driver's map of the arena, or the NVMe tier's state file (once flushed:
        Engine.wait_for_updates)."""
        views = self.layout.hf_views(self.arena.params)
        if self.tier is None or "params" not in self.tier.kinds:
            yield from ((k, v.clone()) for k, v in views.items())
            return
        units = self.layout.units
        first = units[self.tier.from_unit].offset if self.tier.from_unit < len(units) else self.layout.numel
        files = StateFiles.open(self.arena.handle.tier, threads=1)
        try:
            reader = TierReader(files, self.arena.tensors, ("params",), {"params": first})
            yield from ((k, reader.read(v).clone()) for k, v in views.items())
        finally:
            files.close()

    def new_worker(self, index: int) -> Any:
        """Optimizer worker `index` of the run: worker index % n of node index // n."""
        node, worker = divmod(index, self.placements[0].workers)
        p = self.placements[node]
        name = f"optimizer/{index}" if len(self.placements) == 1 else f"optimizer/{node}.{worker}"
        return OptimizerWorker.options(name=self._name(name), **p.worker(worker)).remote(
            [self.handle_refs[node]], self.layout, self.plan.worker_plan(self.optim, p.worker_threads), index,
            self.metrics)

    def new_executors(self) -> list[Any]:
        """The run's executors, joined into one process group when there are several (a new one each time: a
        replacement never joins a group whose member died)."""
        per_node, nodes, world = self.plan.executors, len(self.placements), self.plan.world
        # rank r: executor r % per_node of node r // per_node
        # rank 0, which hosts the rendezvous, runs on the driver's node: its loopback unless other hosts must reach it
        host = "127.0.0.1" if nodes == 1 else ray.util.get_node_ip_address()
        rendezvous = f"tcp://{host}:{free_port()}" if world > 1 else None
        workers_per_node = self.placements[0].workers
        executors = []
        for rank in range(world):
            node, local = divmod(rank, per_node)
            name = "executor" if world == 1 else f"executor/{rank}"
            workers = self.workers[node * workers_per_node : (node + 1) * workers_per_node]
            executors.append(GPUExecutor.options(name=self._name(name), **self.placements[node].executor(local)).remote(
                [self.handle_refs[node]], self.config, self.plan, workers, self.trace, rank, rendezvous))
        return executors

    def _name(self, role: str) -> str:
        return f"megatrain/{self.run_id}/{role}#{self.restarts}"

    def train_step(self, batch: ray.ObjectRef, update: int, pending: list[ray.ObjectRef],
                   speculation: Speculation | None = None) -> ExecutorStep:
        """Forward and backward of `batch` on every executor (each its rows) as update number `update`, on the
        weights of the updates before it (`pending`: the last one's calls), with the update beside the backward
        where `speculation` asks for it; their outputs as one (`merged`)."""
        return merged(get([e.train_step.remote(batch, update, update, pending, speculation)
                           for e in self.executors]), len(self.placements))

    # ---- the update of a step, once the driver knows its gradient norm (pipelines/engine.py: Engine.step_once) ----
    def update(self, step: int, clip_coef: float, speculation: int | None = None) -> list[ray.ObjectRef]:
        """Update number `step` of every unit with `clip_coef`, in forward order: each worker's `apply`, or with
        grads = "device" the executor's `send_grads`; several nodes then exchange the updated weights. Where
        speculation number `speculation` speculated units, each is rolled back and redone clipped (the driver waited
        for those first and took their versions back: `roll_back_versions`). Returns the calls at once."""
        if self.plan.grads == "device":
            refs = [self.executors[0].send_grads.remote(step, clip_coef, speculation)]
        else:
            refs = [w.apply.remote(step, clip_coef, speculation) for w in self.workers]
        return refs + self.exchange(step)

    def confirm(self, step: int, speculation: int) -> list[ray.ObjectRef]:
        """Every unit's update speculated in speculation number `speculation` is confirmed (the step did not clip):
        the gradients the executor held on the device go, and several nodes exchange the updated weights."""
        if self.plan.grads == "device":
            return [self.executors[0].send_grads.remote(step, 1.0, speculation)] + self.exchange(step)
        return self.exchange(step)

    def roll_back(self, step: int, speculation: int) -> None:
        """Step `step` is skipped: the units speculated in speculation number `speculation` are rolled back (with
        grads = "device" from their gradients sent again), and several nodes exchange the weights they own; returns
        when all is done, so that nothing reads a unit before."""
        if self.plan.grads == "device":
            get(self.executors[0].send_grads.remote(step, 0.0, speculation, roll_back=True))
            self.roll_back_versions(step)  # the units that only freed their host slot for the next one
        else:
            get([w.roll_back.remote(step, speculation) for w in self.workers])
        get(self.exchange(step - 1))  # the update before: the weights each node owns, as rolled back

    def roll_back_versions(self, step: int) -> None:
        """Every worker's version of every unit back to `step` (the updates beside the backward are done)."""
        get([w.roll_back_versions.remote(step) for w in self.workers])

    def exchange(self, step: int) -> list[ray.ObjectRef]:
        """Several nodes: each sends the others its part of update number `step`, unit by unit as it is in."""
        return [s.sync_weights.remote(step) for s in self.stores] if len(self.stores) > 1 else []

    def version_range(self) -> tuple[int, int]:
        """(min, max) of every node's version table."""
        if len(self.stores) == 1:
            return self.versions.range()
        ranges = get([s.version_range.remote() for s in self.stores])
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

    def stop(self, close: bool = True) -> None:
        """The stores unlink their arenas (close=False: only that, in a recovery, where a store may be stuck in the
        weight exchange waiting for a dead peer); then every actor is killed."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        try:
            ray.get([s.close.remote() if close else s.unlink.remote() for s in self.stores], timeout=60)
        except Exception as e:  # a store died: its node's next start removes its segments (this node's: shutdown)
            log.warning("a parameter store did not close cleanly (%s)", e)
        for actor in [*self.executors, *self.workers, *self.stores]:
            ray.kill(actor)
        # the arenas' handles stay: they name the segment files, which a caller may check are gone
        self.stores, self.executors, self.workers = [], [], []

    def release(self) -> None:
        """What dead stores left in the other nodes' /dev/shm removed (a store that died there, or one a recovery
        replaced), and the placements given back."""
        try:
            ray.get([remove_dead_segments.options(**p.pinned()).remote() for p in self.placements[1:]], timeout=30)
        except Exception as e:  # noqa: BLE001 - a lost node: its next run there removes them
            log.warning("could not remove dead arena segments on every node (%s)", e)
        for placement in self.placements:
            placement.release()
        self.placements = []


@ray.remote(num_cpus=0)
def remove_dead_segments() -> int:
    """remove_stale_segments on the node this runs on (its MEGATRAIN_SHM_DIR): the arena files of dead owners."""
    return len(remove_stale_segments())
