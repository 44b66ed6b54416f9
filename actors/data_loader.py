"""Ray shell of the data loader: a BatchLoader in its own process with a background thread that has `prefetch` batches
ready, so tokenization and packing overlap the GPU step. Resume is exact through the prefetch: `state_dict()` is the
position of the last batch handed out (docs/design.md#the-data-loader)."""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from actors.termination import exit_on_sigterm
from megatrain.config import MegatrainError, dataclass_from_dict
from megatrain.data import BatchLoader, DataConfig, DataError


@dataclass
class _End:
    error: BaseException | None = None  # None: the data ran out (StopIteration)


class PrefetchLoader:
    """The plain (Ray-free) prefetching wrapper; DataLoaderActor below is this class as a Ray actor."""

    def __init__(self, config: DataConfig | dict[str, Any], prefetch: int = 4):
        if not isinstance(config, DataConfig):
            config = dataclass_from_dict(DataConfig, config, "data config")
        self.loader = BatchLoader(config)
        self.prefetch = max(1, prefetch)
        # positions after each of the latest next_batch calls (the last: after the last batch handed out)
        self._states: deque[dict[str, Any]] = deque([self.loader.state_dict()], maxlen=64)
        self._start()

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True)
        self._thread.start()

    def _produce(self, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item: Any = (self.loader.next_batch(), self.loader.state_dict())
            except StopIteration:
                item = _End()
            except Exception as e:  # handed to the caller of next_batch, which raises it
                item = _End(e)
            while not stop.is_set():  # a blocking put could never be stopped while the queue is full
                try:
                    q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    pass
            if isinstance(item, _End):
                return

    def _halt(self) -> None:
        self._stop.set()
        self._thread.join()

    def next_batch(self) -> dict[str, np.ndarray]:
        """{"input_ids", "labels"}: int64 [batch, seq]. Raises StopIteration after the last epoch (through
        Ray: a RayTaskError that is also a StopIteration)."""
        item = self._queue.get()
        if isinstance(item, _End):
            self._queue.put(item)  # the producer has stopped: answer the same way next time
            self._states.append(self._states[-1])  # a call that handed out nothing leaves the position
            if item.error is not None:
                raise item.error
            raise StopIteration
        batch, state = item
        self._states.append(state)
        return batch

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        """All batches of the held-out split (the training position is untouched)."""
        return list(self.loader.eval_batches())

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """The position after the last batch handed out, or, with `unconsumed` = n, as of n next_batch
        calls earlier (batches the caller holds but has not trained on)."""
        if not 0 <= unconsumed < len(self._states):
            raise DataError(f"state_dict(unconsumed={unconsumed}) reaches back further than the "
                            f"{len(self._states) - 1} next_batch calls remembered; save the position sooner.")
        return dict(self._states[-1 - unconsumed])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._halt()
        try:
            self.loader.load_state_dict(state)
        except Exception:
            self.loader.load_state_dict(self._states[-1])  # the producer ran ahead: back to the handed-out
            raise
        finally:
            self._start()
        self._states = deque([self.loader.state_dict()], maxlen=self._states.maxlen)

    def close(self) -> None:
        self._halt()


@ray.remote(num_cpus=0)  # mostly waiting; give it .options(num_cpus=n) when tokenization is heavy
class DataLoaderActor:
    """PrefetchLoader as an actor. A bad data config is kept and raised by every call, so the caller gets
    the one-sentence DataError instead of an actor that died in its constructor."""

    def __init__(self, config: DataConfig | dict[str, Any], prefetch: int = 4):
        exit_on_sigterm()
        self.loader: PrefetchLoader | None = None
        self.error: MegatrainError | None = None
        try:
            self.loader = PrefetchLoader(config, prefetch)
        except MegatrainError as e:
            self.error = e

    def _ready(self) -> PrefetchLoader:
        if self.error is not None:
            raise self.error
        assert self.loader is not None
        return self.loader

    def next_batch(self) -> dict[str, np.ndarray]:
        return self._ready().next_batch()

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        return self._ready().eval_batches()

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        return self._ready().state_dict(unconsumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ready().load_state_dict(state)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


__all__ = ["DataLoaderActor", "PrefetchLoader"]
