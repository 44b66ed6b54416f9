"""Parquet and Arrow IPC files as a source: shards are row groups / record batches, read one column (or one
record format's columns) at a time."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.data.documents import Doc, Source, as_document
from megatrain.data.formats import FIELDS, NAMES, REQUIRED, detect, to_chat
from megatrain.data.tokenizers import DataError


@dataclass(frozen=True)
class _Columns:
    """How one Parquet / Arrow file is read: one messages/text column, or the columns of Alpaca / ShareGPT
    records (each row read as a record, as a JSON line is)."""

    format: str
    names: list[str]
    chat: bool = False  # messages format: the column holds chats


def pick_columns(names: list[str], path: Path | str, column: str | None, text_field: str, messages_field: str,
                  record_format: str | None, prefer_text: bool) -> _Columns:
    # a named column is one column of documents; else the columns say the format, as a first JSON record does
    fields = (text_field, messages_field) if prefer_text else (messages_field, text_field)
    fmt = record_format or ("messages" if column is not None else detect(dict.fromkeys(names), fields))
    if fmt in REQUIRED:
        missing = [c for c in REQUIRED[fmt] if c not in names]
        if missing:
            raise DataError(f"{path} has no {missing[0]!r} column (its columns are: {', '.join(names)}); "
                            f"{NAMES[fmt]} file needs {' and '.join(REQUIRED[fmt])} columns.")
        return _Columns(fmt, [c for c in FIELDS[fmt] if c in names])
    if column is not None:
        if column not in names:
            raise DataError(f"{path} has no column {column!r} (its columns are: {', '.join(names)}); "
                            "set column to one of them.")
        return _Columns("messages", [column], column == messages_field)
    for name in (text_field, messages_field):
        if name in names:
            return _Columns("messages", [name], name == messages_field)
    raise DataError(f"{path} has no {text_field!r} or {messages_field!r} column (its columns are: "
                    f"{', '.join(names)}); set column to the one holding the documents, or give it Alpaca "
                    "(instruction, output) or ShareGPT (conversations) columns.")


def batch_docs(batch: Any, path: Path | str, columns: _Columns, first_row: int) -> list[Doc]:
    """The documents of a record batch holding (at least) the file's columns."""
    if columns.format == "messages":
        name = columns.names[0]
        values = batch.column(name).to_pylist()
        convert = lambda v, where: as_document(v, where, name, columns.chat)
    else:
        values = batch.select(columns.names).to_pylist()
        convert = lambda v, where: to_chat(v, where, columns.format)
    docs = []
    for i, v in enumerate(values):
        where = f"{path} row {first_row + i}"
        value = convert(v, where)
        if value is not None:
            docs.append(Doc(value, where))
    return docs


class _ColumnarSource(Source):
    """Files of rows cut into parts (Parquet row groups, Arrow record batches): a shard is one part."""

    def __init__(self, files: list[Path], column: str | None, text_field: str, messages_field: str,
                 record_format: str | None = None, prefer_text: bool = False):
        self.name, self.index = str(files[0].parent if len(files) > 1 else files[0]), []
        self.columns: dict[Path, _Columns] = {}
        for f in files:
            names, part_rows = self._layout(f)
            self.columns[f] = pick_columns(names, f, column, text_field, messages_field, record_format, prefer_text)
            first = 0
            for part, n in enumerate(part_rows):
                self.index.append((f, part, first))
                first += n
        self.num_shards = len(self.index)

    @abstractmethod
    def _layout(self, path: Path) -> tuple[list[str], Iterator[int]]:
        """The file's column names, and the row count of each part (counted only once the columns fit)."""


class ParquetSource(_ColumnarSource):
    def _layout(self, path: Path) -> tuple[list[str], Iterator[int]]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise DataError(f"{path} is not a readable Parquet file ({e}); re-export it.") from None
        meta = pf.metadata
        return pf.schema_arrow.names, (meta.row_group(g).num_rows for g in range(meta.num_row_groups))

    def read_shard(self, index: int) -> list[Doc]:
        import pyarrow.parquet as pq

        path, group, first_row = self.index[index]
        columns, docs, row = self.columns[path], [], first_row
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, row_groups=[group], columns=columns.names):
            docs += batch_docs(batch, path, columns, row)
            row += batch.num_rows
        return docs


def _open_arrow(path: Path) -> tuple[Any, bool]:
    """An Arrow IPC reader (file format: random access; stream format: sequential); is it a file?"""
    import pyarrow as pa

    try:
        return pa.ipc.open_file(pa.memory_map(str(path))), True
    except pa.ArrowInvalid:
        pass
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path))), False
    except pa.ArrowInvalid as e:
        raise DataError(f"{path} is not an Arrow IPC file or stream ({e}); re-export or remove it.") from None


class ArrowSource(_ColumnarSource):
    def _layout(self, path: Path) -> tuple[list[str], Iterator[int]]:
        reader, is_file = _open_arrow(path)
        # the stream format has no footer: count its batches (and rows) by reading them one at a time
        part_rows = ((reader.get_batch(i).num_rows for i in range(reader.num_record_batches)) if is_file
                     else (b.num_rows for b in reader))
        return reader.schema.names, part_rows

    def read_shard(self, index: int) -> list[Doc]:
        path, b, first_row = self.index[index]
        reader, is_file = _open_arrow(path)
        if is_file:
            batch = reader.get_batch(b)
        else:
            for i, batch in enumerate(reader):  # noqa: B007 (stop at the b-th batch)
                if i == b:
                    break
        return batch_docs(batch, path, self.columns[path], first_row)


__all__ = ["ArrowSource", "ParquetSource", "batch_docs", "pick_columns"]
