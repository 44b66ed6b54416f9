"""What a document is, and the Source interface every reader implements: a list of shards of documents.

A document is text (`str`), a chat (`list` of `{"role", "content"}` dicts, the `messages` format) or
pre-tokenized ids (`list[int]`); `as_document` checks that a stored value is one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain.data.formats import check_entries
from megatrain.data.tokenizers import DataError, Message

Document = str | list[Message] | list[int]


@dataclass(frozen=True)
class Doc:
    value: Document
    where: str  # for error messages, e.g. "data.jsonl line 7"


class Source(ABC):
    """A list of shards; `read_shard(i)` returns the shard's documents in storage order."""

    name: str
    num_shards: int

    @abstractmethod
    def read_shard(self, index: int) -> list[Doc]: ...


def as_document(value: Any, where: str, field: str, chat: bool = False) -> Document | None:
    """Checks one stored value: text, token ids or a chat; None (skipped) for null and empty values.
    chat: the value is from the messages field, where text is a mistake (a chat encoded twice, say)."""
    if value is None or (isinstance(value, (str, list)) and not value):
        return None
    if isinstance(value, str):
        if chat:
            raise DataError(f"{where}: {field!r} holds a string, not a list of {{role, content}} messages; store the "
                            "chat as a JSON list, or point text_field at plain text.")
        return value
    if isinstance(value, list):
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return [int(v) for v in value]
        if all(isinstance(v, dict) for v in value):
            check_entries(value, where, field, ("role", "content"))
            return value
    raise DataError(f"{where}: {field!r} holds a {type(value).__name__}, not text, token ids or a list of "
                    "messages; point text_field, messages_field or column at the documents.")


__all__ = ["Doc", "Document", "Source", "as_document"]
