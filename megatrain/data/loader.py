"""The batch loader: documents -> tokens -> [batch, seq] int64 numpy batches, resumable at any batch boundary.

    loader = BatchLoader(DataConfig(source="data.jsonl", tokenizer="path/to/model", seq_len=1024))
    batch = loader.next_batch()          # {"input_ids": int64 [B, S], "labels": int64 [B, S]}
    state = loader.state_dict()          # a small JSON-able dict; load_state_dict(state) resumes exactly
    for batch in loader.eval_batches():  # the held-out documents, same packing, one pass
        ...

No Ray here: actors/data_loader.py wraps this class with a prefetch queue.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from megatrain.data.config import DataConfig
from megatrain.data.documents import Doc
from megatrain.data.packing import RowPacker, Sample, make_sample
from megatrain.data.sources import open_source
from megatrain.data.split import EvalSplit
from megatrain.data.stream import DocumentStream
from megatrain.data.tokenizers import DataError, Tokenizer, load_tokenizer

STATE_VERSION = 1


class BatchLoader:
    """Training batches from a DataConfig, resumable at any batch boundary.

    `tokenizer` overrides cfg.tokenizer with any object implementing the Tokenizer interface.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer | None = None):
        self.cfg = cfg
        if tokenizer is None:
            tokenizer = load_tokenizer(cfg.tokenizer, cfg.chat_template)
        self.tokenizer = tok = tokenizer
        if cfg.vocab_size is not None and tok.vocab_size > cfg.vocab_size:
            raise DataError(f"the tokenizer ({tok!r}) has {tok.vocab_size} tokens but the model's "
                            f"embedding has {cfg.vocab_size} rows (vocab_size); use the model's own "
                            "tokenizer or a model with a larger vocabulary.")
        self.vocab_limit = cfg.vocab_size if cfg.vocab_size is not None else tok.vocab_size
        self.format, self.source = open_source(cfg)
        first = self._first_doc()
        is_chat = isinstance(first.value, list) and isinstance(first.value[0], dict)
        self.sft = is_chat if cfg.sft is None else cfg.sft
        self.split = EvalSplit(self.source, cfg.eval_fraction, cfg.eval_count)
        self.stream = DocumentStream(self.source, self.split, cfg.seed, cfg.shuffle, cfg.epochs)
        self.packer = RowPacker(cfg.batch_size * cfg.micro_batches, cfg.seq_len, tok.pad_id, cfg.pack, cfg.truncation,
                                cfg.document_positions)
        self.batches = 0  # handed out since the start of the data
        self._sample_position = self.stream.position()  # stream position before the latest sample

    def _first_doc(self) -> Doc:
        for s in range(self.source.num_shards):
            docs = self.source.read_shard(s)
            if docs:
                return docs[0]
        raise DataError(f"{self.source.name} holds no documents; check its contents and the field or column "
                        "names (text_field, messages_field, column).")

    def _next_sample(self, docs: Iterator[Doc]) -> Sample:
        while True:  # skips documents without tokens; raises StopIteration at the end
            sample = make_sample(next(docs), self.tokenizer, self.sft, self.vocab_limit)
            if sample is not None:
                return sample

    def _next_train_sample(self) -> Sample:
        self._sample_position = self.stream.position()
        return self._next_sample(self.stream)

    def next_batch(self) -> dict[str, np.ndarray]:
        """{"input_ids", "labels"}: int64 [batch_size * micro_batches, seq_len] (and "position_ids" with
        document_positions). Raises StopIteration after the last epoch."""
        batch = self.packer.batch(self._next_train_sample)
        if batch is None:
            raise StopIteration
        self.batches += 1
        return batch

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next_batch()

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the held-out documents in storage order, packed like training batches."""
        docs = iter(self.split.docs())
        c = self.cfg
        packer = RowPacker(c.batch_size * c.micro_batches, c.seq_len, self.tokenizer.pad_id, c.pack, c.truncation,
                           c.document_positions)
        while (batch := packer.batch(lambda: self._next_sample(docs))) is not None:
            yield batch

    # ---- exact position ----

    def _fingerprint(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same batches (not the path: data may move)."""
        c = self.cfg
        tokenizer = f"{type(self.tokenizer).__name__}:{self.tokenizer.vocab_size}"
        return {"format": self.format, "num_shards": self.source.num_shards, "tokenizer": tokenizer,
                "batch_size": c.batch_size, **({"micro_batches": c.micro_batches} if c.micro_batches != 1 else {}),
                "seq_len": c.seq_len, "seed": c.seed, "shuffle": c.shuffle,
                "pack": c.pack, "sft": self.sft, "eval_fraction": c.eval_fraction, "eval_count": c.eval_count}

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out: a plain JSON-able dict."""
        pending = self.packer.pending is not None
        return {
            "version": STATE_VERSION,
            # while a sample is half consumed, resume from just before it and skip `offset` of its tokens
            "position": dict(self._sample_position if pending else self.stream.position()),
            "offset": self.packer.offset if pending else 0,
            "batches": self.batches,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"the saved data position has version {state.get('version')!r}, not "
                            f"{STATE_VERSION}; start the data from the beginning.")
        mine = self._fingerprint()
        for key, saved in state["fingerprint"].items():
            if mine.get(key) != saved:
                raise DataError(f"the saved data position was made with {key}={saved!r} but this loader "
                                f"has {key}={mine.get(key)!r}; resume with the same data config, or start "
                                "the data from the beginning.")
        self.stream.seek(state["position"])
        self.packer.pending, self.packer.offset = None, 0
        self._sample_position = self.stream.position()
        if state["offset"]:
            try:
                self.packer.pending = self._next_train_sample()
            except StopIteration:
                raise DataError("the saved data position points past the end of the data; the data changed "
                                "since it was saved, so start the data from the beginning.") from None
            self.packer.offset = int(state["offset"])
        self.batches = int(state["batches"])


__all__ = ["BatchLoader"]
