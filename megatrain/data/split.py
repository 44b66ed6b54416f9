"""The eval split: which documents are held out of training, and reading them back."""

from __future__ import annotations

import numpy as np

from megatrain.data.documents import Doc, Source
from megatrain.data.tokenizers import DataError

_EVAL_SEED = 0x5EED  # the eval split ignores the shuffle seed: changing the seed never leaks eval into train


class EvalSplit:
    """Which documents are held out: `count` = the first documents in storage order; `fraction` = each
    document independently with that probability, from a fixed seed (not the shuffle seed)."""

    def __init__(self, source: Source, fraction: float = 0.0, count: int = 0):
        self.source, self.fraction, self.count = source, fraction, count
        self._docs: list[Doc] | None = None
        self._held: dict[int, int] = {}  # count mode: shard -> how many of its first documents are held out
        if count:
            docs: list[Doc] = []
            more = False
            for s in range(source.num_shards):
                shard = source.read_shard(s)
                take = min(len(shard), count - len(docs))
                if take:
                    self._held[s] = take
                    docs += shard[:take]
                if len(shard) > take:
                    more = True
                if len(docs) == count and more:
                    break
            if not more:
                raise DataError(f"eval_count={count} holds out all {len(docs)} documents of {source.name}, "
                                "leaving none to train on; lower eval_count.")
            self._docs = docs

    def is_eval(self, shard: int, n: int) -> np.ndarray:
        """A bool mask over the n documents of a shard: True = held out."""
        if self.fraction:
            return np.random.default_rng([_EVAL_SEED, shard]).random(n) < self.fraction
        mask = np.zeros(n, dtype=bool)
        mask[: self._held.get(shard, 0)] = True
        return mask

    def docs(self) -> list[Doc]:
        """The held-out documents in storage order (read once, then kept)."""
        if self._docs is None:
            self._docs = []
            if self.fraction:
                for s in range(self.source.num_shards):
                    shard = self.source.read_shard(s)
                    held = self.is_eval(s, len(shard))
                    self._docs += [d for d, h in zip(shard, held, strict=True) if h]
        return self._docs


__all__ = ["EvalSplit"]
