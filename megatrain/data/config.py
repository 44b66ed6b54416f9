"""The data config: what to read, how to tokenize and pack it, and how to split, shuffle and batch it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from numbers import Real
from typing import Any

from megatrain.config import ConfigError
from megatrain.data.files import FORMATS
from megatrain.data.formats import RECORD_FORMATS


@dataclass
class DataConfig:
    # "synthetic", a file or folder, a `datasets` save_to_disk directory, or a Hugging Face Hub data set (org/name)
    source: str = "synthetic"
    # None: from the file extension; synthetic | text | jsonl | parquet | arrow | datasets (load_dataset reads it)
    format: str | None = None
    split: str = "train"  # a `datasets` source: the split to read...
    subset: str | None = None  # ...of this configuration of the data set (load_dataset's name)
    streaming: bool | None = None  # ...streamed (None: a Hub data set streams, files on disk do not)
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
        check(isinstance(self.split, str) and bool(self.split), "split must be a split's name", self.split)
        check(self.streaming is None or isinstance(self.streaming, bool), "streaming must be true, false or None",
              self.streaming)
        for name in ("column", "chat_template", "subset"):
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


__all__ = ["DataConfig"]
