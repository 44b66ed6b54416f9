"""Tokenized samples (BOS, document, EOS; labels as HF transformers has them) and the rows they are packed into.

`pack=True` cuts the stream of samples into rows of seq_len (`document_positions` restarts positions per document);
`pack=False` puts one right-padded sample per row. Every batch has the same [batch_size, seq_len] shape. Labels,
SFT masks and positions: docs/design.md#packing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatrain.data.documents import Doc
from megatrain.data.tokenizers import DataError, Tokenizer

IGNORE = -100  # HF / torch cross-entropy ignore_index


@dataclass
class Sample:
    ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int64 [n]
    where: str

    def __len__(self) -> int:
        return len(self.ids)


def make_sample(doc: Doc, tokenizer: Tokenizer, sft: bool, vocab_limit: int | None) -> Sample | None:
    """Tokenizes one document (None when it has no tokens) and checks its ids against the vocabulary."""
    value = doc.value
    is_chat = isinstance(value, list) and bool(value) and isinstance(value[0], dict)
    if sft and not is_chat:
        raise DataError(f"sft is on but {doc.where} is not a chat; give chat documents (a messages field or "
                        "column) or set sft=False to train on every token.")
    if is_chat:
        ids, mask = tokenizer.apply_chat(value)
    else:
        ids = tokenizer.encode(value) if isinstance(value, str) else list(value)
        mask = [True] * len(ids)
    if not ids:
        return None
    if not sft:
        mask = [True] * len(ids)
    if tokenizer.bos_id is not None and ids[0] != tokenizer.bos_id:
        ids, mask = [tokenizer.bos_id, *ids], [not sft, *mask]
    if tokenizer.eos_id is not None and ids[-1] != tokenizer.eos_id:
        ids, mask = [*ids, tokenizer.eos_id], [*mask, mask[-1]]  # trained when it closes a trained turn
    arr = np.asarray(ids, dtype=np.int64)
    if vocab_limit is not None and (arr.min() < 0 or arr.max() >= vocab_limit):
        bad = int(arr.max() if arr.max() >= vocab_limit else arr.min())
        raise DataError(f"{doc.where} has token id {bad}, outside the model's vocabulary [0, {vocab_limit}); "
                        "tokenize the data with this model's tokenizer or set vocab_size to the model's.")
    labels = np.where(np.asarray(mask, dtype=bool), arr, IGNORE)
    return Sample(arr, labels, doc.where)


class RowPacker:
    """Turns a stream of samples into [batch_size, seq_len] batches.

    In pack mode it remembers the sample it is in the middle of (`pending`, consumed up to `offset`): the
    loader saves where that sample came from plus `offset`, which is all it takes to resume exactly.
    """

    def __init__(self, batch_size: int, seq_len: int, pad_id: int, pack: bool = True,
                 truncation: bool = True, document_positions: bool = False):
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.pack, self.truncation = pack, truncation
        self.document_positions = document_positions and pack  # unpacked rows are one document each already
        self.pending: Sample | None = None
        self.offset = 0

    def batch(self, next_sample: Callable[[], Sample]) -> dict[str, np.ndarray] | None:
        """The next batch, drawing samples from `next_sample` (which raises StopIteration at the end);
        None when no token is left."""
        b, s = self.batch_size, self.seq_len
        ids = np.full(b * s, self.pad_id, dtype=np.int64)
        labels = np.full(b * s, IGNORE, dtype=np.int64)
        positions = np.zeros(b * s, dtype=np.int64) if self.document_positions else None
        filled = 0
        if self.pack:
            while filled < b * s:
                if self.pending is None:
                    try:
                        self.pending, self.offset = next_sample(), 0
                    except StopIteration:
                        break
                take = min(b * s - filled, len(self.pending) - self.offset)
                ids[filled : filled + take] = self.pending.ids[self.offset : self.offset + take]
                labels[filled : filled + take] = self.pending.labels[self.offset : self.offset + take]
                if positions is not None:
                    positions[filled : filled + take] = np.arange(self.offset, self.offset + take)
                filled, self.offset = filled + take, self.offset + take
                if self.offset == len(self.pending):
                    self.pending, self.offset = None, 0
        else:
            for row in range(b):
                try:
                    sample = next_sample()
                except StopIteration:
                    break
                if len(sample) > s and not self.truncation:
                    raise DataError(f"{sample.where} is {len(sample)} tokens long, more than seq_len={s}; "
                                    "raise seq_len, set truncation=True, or use pack=True.")
                n = min(len(sample), s)
                ids[row * s : row * s + n] = sample.ids[:n]
                labels[row * s : row * s + n] = sample.labels[:n]
                filled = row * s + n
        if filled == 0:
            return None
        batch = {"input_ids": ids.reshape(b, s), "labels": labels.reshape(b, s)}
        if positions is not None:
            positions[filled:] = np.arange(b * s - filled)
            batch["position_ids"] = positions.reshape(b, s)
        return batch


__all__ = ["IGNORE", "RowPacker", "Sample", "make_sample"]
