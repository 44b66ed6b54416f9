"""Ray shell of the parameter store: owns the arena for the run and unlinks it on the way out."""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import ray

from actors.termination import exit_on_sigterm
from megatrain.config import MegatrainError, ModelConfig
from megatrain.memory.arena import ArenaHandle
from megatrain.run_plan import RunPlan
from megatrain.store import ParameterStore


# Several nodes: the weight exchange runs on a thread of its own, so that the store still answers (a health check,
# a recovery's questions) while it waits for its workers or for another node.
@ray.remote(num_cpus=0, concurrency_groups={"sync": 1})
class ParameterStoreActor:
    def __init__(self, model: str | ModelConfig, plan: RunPlan, node: int = 0, run_id: str | None = None,
                 adapter: str | None = None):
        """Node `node`'s store of the run `plan` describes (its arena: plan.store)."""
        # A user error (a model that does not fit, a corrupt weights file) is kept for handle() to raise: raised
        # here, Ray would turn it into an ActorDiedError carrying the traceback as its message.
        self.init_error: MegatrainError | None = None
        self.store: ParameterStore | None = None
        # Unlink the arena however this process ends short of SIGKILL (that case: the next start cleans up).
        exit_on_sigterm(self.close)
        try:
            self.store = ParameterStore(model, plan.store, node=node, run_id=run_id, adapter=adapter,
                                        verify=False)  # the driver's resolve_model made its checks
        except MegatrainError as e:
            self.init_error = e
            return
        atexit.register(self.store.close)

    def handle(self) -> ArenaHandle:
        """The arena's handle, the first call the driver makes (and where a failed start is reported)."""
        if self.init_error is not None:
            raise self.init_error
        return self.store.handle

    def config(self) -> ModelConfig:
        return self.store.config

    def model_dir(self) -> str | None:
        """The HF directory the model was read from (its tokenizer, its generation config), if any."""
        return None if self.store.source_dir is None else str(self.store.source_dir)

    def pid(self) -> int:
        return os.getpid()

    def reinitialize(self) -> None:
        self.store.reinitialize()

    def set_version(self, updates_applied: int) -> None:
        self.store.set_version(updates_applied)

    def write_checkpoint_part(self, directory: str, state: dict[str, Any] | None) -> None:
        self.store.write_checkpoint_part(Path(directory), state)

    def join_nodes(self, address: str) -> None:
        self.store.join_nodes(address)

    @ray.method(concurrency_group="sync")
    def sync_weights(self, step: int) -> list[Any]:
        """Returns no spans: the driver adds a step's pending calls' spans up, and this call's wait is a stall of
        the executors, recorded there."""
        self.store.sync_weights(step)
        return []

    def version_range(self) -> tuple[int, int]:
        return self.store.version_range()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.store.load_checkpoint(directory)

    def save_pretrained(self, directory: str, extra_files: list[str] | None = None, merge: bool = False) -> str:
        return str(self.store.save_pretrained(directory, [Path(f) for f in extra_files or []], merge))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def unlink(self) -> None:
        """Removes the arena's files, the mappings staying valid: before a recovery kills this store, which may be
        stuck in the weight exchange with a dead peer (so `close` could wait for it)."""
        if self.store is not None:
            self.store.unlink()
