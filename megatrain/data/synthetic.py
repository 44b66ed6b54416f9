"""The synthetic source: seeded, learnable documents that need no files (the default data)."""

from __future__ import annotations

import numpy as np

from megatrain.data.documents import Doc, Source

_LETTERS = "abcdefghijklmnop"


def synthetic_document(rng: np.random.Generator) -> str:
    """One learnable document: half are a short random word repeated ("kcb kcb kcb ..."), half count up
    from a random number ("417 418 419 ..."). Letter and digit statistics are learned in a few steps, then
    copying and counting drive the loss far below the unigram level."""
    reps = int(rng.integers(8, 40))
    if rng.random() < 0.5:
        word = "".join(_LETTERS[i] for i in rng.integers(0, len(_LETTERS), size=int(rng.integers(3, 7))))
        return " ".join([word] * reps)
    start = int(rng.integers(0, 1000))
    return " ".join(str(start + i) for i in range(reps))


class SyntheticSource(Source):
    docs_per_shard = 100

    def __init__(self, num_docs: int, seed: int):
        self.name, self.num_docs, self.seed = "synthetic", num_docs, seed
        self.num_shards = -(-num_docs // self.docs_per_shard)

    def read_shard(self, index: int) -> list[Doc]:
        rng = np.random.default_rng([self.seed, index])
        first = index * self.docs_per_shard
        n = min(self.docs_per_shard, self.num_docs - first)
        return [Doc(synthetic_document(rng), f"synthetic document {first + i}") for i in range(n)]


__all__ = ["SyntheticSource", "synthetic_document"]
