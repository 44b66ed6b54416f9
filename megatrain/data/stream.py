"""The training document stream: shuffled per epoch, for some epochs or forever, resumable from an exact position.

Shuffling is two-level: the shard order is permuted per epoch, then the documents inside each shard. A
position is therefore (epoch, shard slot, document slot): three integers from which a stream resumes
exactly, re-reading one shard.
"""

from __future__ import annotations

import numpy as np

from megatrain.data.documents import Doc, Source
from megatrain.data.split import EvalSplit
from megatrain.data.tokenizers import DataError


class DocumentStream:
    """Training documents, shuffled per epoch, for `epochs` epochs (None: forever), from an exact position."""

    def __init__(self, source: Source, split: EvalSplit, seed: int = 0, shuffle: bool = True,
                 epochs: int | None = None):
        self.source, self.split, self.seed, self.shuffle, self.epochs = source, split, seed, shuffle, epochs
        self.epoch = self.shard = self.doc = 0
        self._cache: tuple[tuple[int, int], list[Doc]] | None = None
        self._empty_epoch = False  # True while an epoch read from its start has yielded nothing yet

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "doc": self.doc}

    def seek(self, position: dict[str, int]) -> None:
        self.epoch, self.shard, self.doc = (int(position[k]) for k in ("epoch", "shard", "doc"))
        self._empty_epoch = False

    def _shard_docs(self) -> list[Doc]:
        key = (self.epoch, self.shard)
        if self._cache is None or self._cache[0] != key:
            order = np.arange(self.source.num_shards)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            sid = int(order[self.shard])
            docs = self.source.read_shard(sid)
            keep = np.flatnonzero(~self.split.is_eval(sid, len(docs)))
            if self.shuffle:
                keep = np.random.default_rng([self.seed, self.epoch, sid]).permutation(keep)
            self._cache = (key, [docs[i] for i in keep])
        return self._cache[1]

    def __iter__(self) -> DocumentStream:
        return self

    def __next__(self) -> Doc:
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                raise StopIteration
            if self.shard == 0 and self.doc == 0:
                self._empty_epoch = True
            docs = self._shard_docs()
            if self.doc < len(docs):
                self.doc += 1
                self._empty_epoch = False
                return docs[self.doc - 1]
            self.shard, self.doc = self.shard + 1, 0
            if self.shard == self.source.num_shards:
                if self._empty_epoch:
                    raise DataError(f"{self.source.name} has no training documents left after the eval "
                                    "split; lower eval_fraction or eval_count, or add data.")
                self.epoch, self.shard = self.epoch + 1, 0


__all__ = ["DocumentStream"]
