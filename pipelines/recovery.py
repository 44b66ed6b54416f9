"""Recovery: what the driver does when an actor of the run dies, and the replay log that makes it exact.

A lost executor alone redoes its step; a lost worker (or an executor with updates under way) restores the last
checkpoint and replays the logged batches, bit-identical on the CPU; a lost store stops the run
(docs/design.md#recovery)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray
import torch

from megatrain.config import MegatrainError, cause_chain
from megatrain.memory.versions import settled_range
from pipelines.run_actors import RunActors, get

log = logging.getLogger(__name__)

ACTOR_DEATH = (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError)


def is_actor_death(e: BaseException) -> bool:
    """An actor process died (possibly seen through another actor's task), as opposed to a user error."""
    return any(isinstance(c, ACTOR_DEATH) for c in cause_chain(e))


def is_cuda_error(e: BaseException) -> bool:
    """A CUDA error inside an actor: its context is unusable afterwards, so the actor must be replaced."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return any(isinstance(c, accelerator_error) or (isinstance(c, RuntimeError) and "CUDA error" in str(c))
               for c in cause_chain(e))


def is_collective_failure(e: BaseException) -> bool:
    """A collective between executors failed (gloo, NCCL): how a peer's death reaches the executors that outlive it,
    often before Ray reports the death itself (a killed executor's peer blocked in its all_reduce: "Connection reset
    by peer")."""
    dist_error = getattr(torch.distributed, "DistError", ())
    return any(isinstance(c, dist_error) or (isinstance(c, RuntimeError) and ("gloo" in str(c) or "NCCL" in str(c)))
               for c in cause_chain(e))


def is_fault(e: BaseException) -> bool:
    """What a recovery is for: an actor died, its CUDA context broke, or a collective failed; the recovery finds out
    which actors died and raises `e` again where none did."""
    return isinstance(e, ray.exceptions.RayError) and (is_actor_death(e) or is_cuda_error(e)
                                                        or is_collective_failure(e))


def alive(actor: Any, timeout: float = 60.0) -> bool:
    """Whether `actor` answers within `timeout`: one that does not (stuck in a collective with a dead peer) is as
    good as dead to a recovery, which replaces it."""
    try:
        ray.get(actor.pid.remote(), timeout=timeout)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


@dataclass
class ReplayLog:
    """The batches since the last checkpoint: a replay runs them again from it."""

    max_steps: int  # past it the batches are dropped (Ray's object store holds them) and a replay is refused
    batches: list[ray.ObjectRef] = field(default_factory=list)
    complete: bool = True  # False once batches were dropped: no exact replay until the next checkpoint
    checkpoint: Path | None = None  # where a replay starts; None: the initial weights

    def add(self, batch: ray.ObjectRef) -> None:
        if len(self.batches) >= self.max_steps:
            if self.complete:
                log.warning("%d steps without a checkpoint: the batches logged to replay them after a fault are "
                            "dropped; save checkpoints more often to keep faults recoverable", len(self.batches))
            self.batches, self.complete = [], False
        self.batches.append(batch)

    def drop_last(self) -> None:
        """The last batch trained nothing (refused): a replay leaves it out."""
        self.batches.pop()

    def restart_at(self, checkpoint: Path) -> None:
        """A checkpoint was saved or loaded: replays start there."""
        self.checkpoint, self.batches, self.complete = checkpoint, [], True


class Run(Protocol):
    """What a recovery needs of the driver it recovers (pipelines/engine.py: Engine)."""

    steps_done: int
    updates_applied: int
    nonfinite_in_row: int
    pending: list[ray.ObjectRef]  # the last step's updates

    @property
    def updates_after_step(self) -> bool: ...

    def set_state(self, state: dict[str, Any]) -> None: ...

    def step_once(self, batch: ray.ObjectRef) -> Any: ...


class Recovery:
    """Replaces the actors that died, and where an update may be half applied, restores the last checkpoint and
    replays the steps since."""

    def __init__(self, run: Run, actors: RunActors, max_restarts: int, max_replay_steps: int) -> None:
        self.run, self.actors, self.max_restarts = run, actors, max_restarts
        self.replay = ReplayLog(max_replay_steps)
        self.faults_in_row = 0  # deaths since the last completed step: max_restarts bounds these
        self.replayed_steps = 0  # steps recomputed from a checkpoint to recover (work lost to faults)

    def step_completed(self) -> None:
        self.faults_in_row = 0

    def recover(self, error: BaseException, step_in_flight: bool = True) -> None:
        """The run as it was before its step in flight (the replay log's last batch, which the caller runs again),
        or with step_in_flight=False, as after the last step."""
        while True:
            self.actors.restarts += 1
            self.faults_in_row += 1
            if self.faults_in_row > self.max_restarts:
                raise MegatrainError(f"actors died {self.max_restarts} times without a step completing in between "
                                     f"(last: {str(error).splitlines()[0]}); giving up, "
                                     "check the Ray logs (/tmp/ray/session_latest/logs) for the cause.") from None
            try:
                self._recover_once(error, step_in_flight)
                return
            except ray.exceptions.RayError as e:
                if not is_actor_death(e):
                    raise
                error = e

    def _recover_once(self, error: BaseException, step_in_flight: bool) -> None:
        actors, run = self.actors, self.run
        self._check_stores()
        dead_workers = [i for i, w in enumerate(actors.workers) if not alive(w)]
        if not dead_workers and all(alive(e) for e in actors.executors) and not is_cuda_error(error):
            raise error  # nothing of the engine died: the fault is upstream (e.g. the batch's producer)
        if dead_workers and len(actors.stores) > 1:
            # the dead worker's node cannot finish its part of the update, and the other nodes' stores may be waiting
            # for it inside the weight exchange: every actor is replaced (new arenas), then restored and replayed
            run.pending = []
            actors.replace_all()
            self._restore_and_replay("an optimizer worker", step_in_flight)
            return
        for i in dead_workers:
            actors.workers[i] = actors.new_worker(i)
        for executor in actors.executors:  # dead already, holding handles of dead workers, or in a broken group
            ray.kill(executor)
        if run.updates_after_step and not dead_workers:
            try:
                # the previous step's updates, issued by the driver, run to completion (with grads = "device"
                # only if they were all issued before the executor died: its gradients died with it)
                ray.get(run.pending)
            except ray.exceptions.RayError as e:
                if not is_actor_death(e):
                    raise
                dead_workers = [-1]
        run.pending = []
        actors.flush_tier()  # the NVMe tier's I/O done, its read-ahead dropped: nothing stale read from it after
        versions = settled_range(actors.version_range)  # once updates already queued at the workers have finished
        consistent = not dead_workers and versions == (run.updates_applied, run.updates_applied)
        actors.executors = actors.new_executors()
        ray.get([e.device.remote() for e in actors.executors] + [w.numel.remote() for w in actors.workers])
        if consistent:
            log.warning("the GPU executor died; a new one mapped the same arena and redoes step %d", run.steps_done)
            return
        self._restore_and_replay("an optimizer worker" if dead_workers else "the GPU executor", step_in_flight)

    def _restore_and_replay(self, who: str, step_in_flight: bool) -> None:
        """The arenas back to the last checkpoint (or the initial weights), and the steps since run again."""
        if not self.replay.complete:
            raise MegatrainError(f"an actor died during an update and the steps since the last checkpoint "
                                 f"(more than max_replay_steps={self.replay.max_steps}) cannot be replayed; resume "
                                 "from the last checkpoint, and save checkpoints more often.")
        replay = self.replay.batches[:-1] if step_in_flight else list(self.replay.batches)
        source = self.replay.checkpoint or "the initial weights"
        log.warning("%s died during an update; restoring %s and replaying %d step(s)", who, source, len(replay))
        self._restore_last_checkpoint()
        self.replayed_steps += len(replay)
        for batch in replay:
            self.run.step_once(batch)

    def _check_stores(self) -> None:
        """A dead parameter store took its arena with it: the run stops, saying which node and how to go on."""
        stores = self.actors.stores
        for m, store in enumerate(stores):
            if alive(store):
                continue
            if len(stores) == 1:
                raise MegatrainError("the parameter store died, and the arena with it; restart the run with --resume "
                                     "to continue from the last checkpoint.")
            node = self.actors.placements[m].node_id
            ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), "address unknown")
            raise MegatrainError(f"node {m} of the run ({ip}, Ray node {node[:8]}) was lost: its parameter store "
                                 f"died with its arena; restart the run with --resume to continue from the last "
                                 f"checkpoint, on {len(stores)} nodes once it is back or on fewer (--nodes "
                                 f"{len(stores) - 1}: checkpoints reshard).")

    def _restore_last_checkpoint(self) -> None:
        stores = self.actors.stores
        if self.replay.checkpoint is not None:
            self.run.set_state(get([s.load_checkpoint.remote(str(self.replay.checkpoint)) for s in stores])[0])
        else:
            get([s.reinitialize.remote() for s in stores])
            self.run.set_state({"steps_done": 0, "updates_applied": 0, "skipped_steps": 0})
        get([e.load_resident.remote() for e in self.actors.executors])  # units resident on a device: from the arena
        self.run.nonfinite_in_row = 0
