"""The data config and the batch loader: documents -> tokens -> [batch, seq] int64 numpy batches.

    loader = BatchLoader(DataConfig(source="data.jsonl", tokenizer="path/to/model", seq_len=1024))
    batch = loader.next_batch()          # {"input_ids": int64 [B, S], "labels": int64 [B, S]}
    state = loader.state_dict()          # a small JSON-able dict; load_state_dict(state) resumes exactly
    for batch in loader.eval_batches():  # the held-out documents, same packing, one pass
        ...

No Ray here: actors/data_loader.py wraps this class with a prefetch queue.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from numbers import Real
from typing import Any

import numpy as np

from megatrain.config import ConfigError
from megatrain.data.formats import RECORD_FORMATS
from megatrain.data.packing import RowPacker, Sample, make_sample
from megatrain.data.sources import FORMATS, Doc, DocumentStream, EvalSplit, open_source
from megatrain.data.tokenizers import DataError, Tokenizer, load_tokenizer

STATE_VERSION = 1


@dataclass
class DataConfig:
    source: str = "synthetic"  # "synthetic", or a file or folder
    format: str | None = None  # None: from the file extension; synthetic | text | jsonl | parquet | arrow
    # JSON / JSONL records (Parquet / Arrow rows): None = detected per file from its first record (its columns);
    # messages (messages_field or text_field) | alpaca (instruction, input, output) | sharegpt (conversations)
    record_format: str | None = None
    text_field: str = "text"  # JSONL field / Parquet-Arrow column holding text (or token-id lists)
    messages_field: str = "messages"  # JSONL field / column holding chats: [{"role", "content"}, ...]
    column: str | None = None  # Parquet/Arrow: the column to read (None: text_field, else messages_field)
    text_split: str = "paragraph"  # text files: "paragraph" (blank-line separated) or "file" (one doc each)
    tokenizer: str = "byte"  # "byte", or a model directory / tokenizer.json path
    chat_template: str | None = None  # overrides the tokenizer's: a Jinja string or a .jinja file
    batch_size: int = 8  # rows of a micro-batch: a step's batch is micro_batches of them
    micro_batches: int = 1
    seq_len: int = 256
    seed: int = 0  # shuffle order (and the synthetic data's content)
    shuffle: bool = True
    epochs: int | None = None  # None: forever
    eval_fraction: float = 0.0  # hold out this fraction of documents...
    eval_count: int = 0  # ...or this many (the first in storage order); not both
    pack: bool = True  # True: concatenate and cut; False: one document per row, padded
    truncation: bool = True  # pack=False: cut long documents to seq_len (False: refuse them)
    # pack=True: batches carry position_ids that restart at each document, so that a document attends within
    # itself only and its positions count from its start (as transformers reads packed position_ids)
    document_positions: bool = False
    sft: bool | None = None  # train on assistant turns only; None: on when the data holds chats
    vocab_size: int | None = None  # the model's embedding rows: tokenizer and ids are checked against it
    synthetic_docs: int = 10_000  # size of the synthetic data set
    shard_bytes: int = 1 << 20  # text/JSONL: bytes per shard (the unit of shuffling and of resume re-reads)

    def __post_init__(self) -> None:
        def check(ok: bool, what: str, value: object) -> None:
            if not ok:
                raise ConfigError(f"data config: {what}, got {value!r}.")

        def count(value: object, least: int) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= least

        # Python callers may pass pathlib paths; kept as str so to_dict() stays JSON-able and the tokenizer's
        # `.endswith(".jinja")` test works (a number or list is refused below rather than str()-ed into a path)
        for name in ("source", "tokenizer", "chat_template"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        for name in ("source", "tokenizer", "text_field", "messages_field"):
            check(isinstance(getattr(self, name), str), f"{name} must be a string", getattr(self, name))
        for name in ("column", "chat_template"):
            value = getattr(self, name)
            check(value is None or isinstance(value, str), f"{name} must be a string or None", value)
        # flags are read by truthiness later: a TOML `shuffle = "no"` or `pack = 0` would silently mean the
        # opposite of what was meant, so only real booleans pass
        for name in ("shuffle", "pack", "truncation", "document_positions"):
            check(isinstance(getattr(self, name), bool), f"{name} must be true or false", getattr(self, name))
        check(self.sft is None or isinstance(self.sft, bool),
              "sft must be true, false or None (on when the data holds chats)", self.sft)
        for name in ("batch_size", "micro_batches", "seq_len", "synthetic_docs", "shard_bytes"):
            check(count(getattr(self, name), 1), f"{name} must be a positive integer", getattr(self, name))
        check(self.seq_len >= 2, "seq_len must be at least 2 to have a next token", self.seq_len)
        check(self.format is None or self.format in FORMATS,
              f"format must be one of {', '.join(FORMATS)} (or None: from the extension)", self.format)
        check(self.record_format is None or self.record_format in RECORD_FORMATS,
              f"record_format must be one of {', '.join(RECORD_FORMATS)} (or None: detected per file)",
              self.record_format)
        check(self.text_split in ("paragraph", "file"),
              "text_split must be 'paragraph' or 'file'", self.text_split)
        check(self.epochs is None or count(self.epochs, 1),
              "epochs must be a positive integer or None (forever)", self.epochs)
        fraction = self.eval_fraction  # the type test first: comparing a string would raise a TypeError
        check(isinstance(fraction, Real) and not isinstance(fraction, bool) and 0.0 <= fraction < 1.0,
              "eval_fraction must be a number in [0, 1)", fraction)
        check(count(self.eval_count, 0), "eval_count must be a non-negative integer", self.eval_count)
        if self.eval_fraction and self.eval_count:
            raise ConfigError("data config: set eval_fraction or eval_count, not both.")
        check(count(self.seed, 0), "seed must be a non-negative integer", self.seed)
        check(self.vocab_size is None or count(self.vocab_size, 1),
              "vocab_size must be a positive integer or None", self.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


__all__ = ["BatchLoader", "DataConfig"]
