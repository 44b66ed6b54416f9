"""JSON Lines files (and files holding one JSON array) as a source: each record, in any record format of
formats.py, becomes one document."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatrain.data.byte_ranges import line_shards, read_range
from megatrain.data.documents import Doc, Document, Source, as_document
from megatrain.data.formats import NAMES, REQUIRED, detect, fits, to_chat
from megatrain.data.json_array import array_records, array_shards, is_json_array
from megatrain.data.tokenizers import DataError


def _parse_line(raw: bytes, where: str, fix: str = "fix or remove that line") -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise DataError(f"{where} is not valid JSON ({detail}); {fix}.") from None


def _line_records(path: Path, start: int, end: int, first_line: int) -> Iterator[tuple[Any, str]]:
    for j, raw in enumerate(read_range(path, start, end).split(b"\n")):
        if raw.strip():
            where = f"{path} line {first_line + j}"
            yield _parse_line(raw, where), where


def _first_line_record(path: Path) -> tuple[Any, str] | None:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                where = f"{path} line {n}"
                # a first line that is no record is most often a whole file of another shape (one object
                # pretty-printed over many lines, say): say which shapes are read
                fix = ("a JSON file holds one record per line or one array of records, so fix that line or "
                       "rewrite the file in one of those shapes")
                return _parse_line(raw, where, fix), where
    return None


def _as_record(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{where} holds a JSON {type(value).__name__}, not an object; make every record a JSON "
                        "object.")
    return value


class JsonlSource(Source):
    """JSON Lines files, or files holding one JSON array of records, in any record format of formats.py:
    detected per file from its first record, or `record_format` for every file."""

    def __init__(self, files: list[Path], shard_bytes: int, text_field: str, messages_field: str,
                 prefer_text: bool, record_format: str | None = None):
        self.name, self.files = str(files[0].parent if len(files) > 1 else files[0]), files
        self.fields = (text_field, messages_field) if prefer_text else (messages_field, text_field)
        self.messages_field, self.record_format = messages_field, record_format
        self.arrays: set[Path] = set()
        self.formats: dict[Path, tuple[str, str]] = {}  # file -> its record format, and the record that said so
        self.index: list[tuple[Path, int, int, int, int]] = []  # file, start, end, first record, its line
        for f in files:
            if is_json_array(f):
                self.arrays.add(f)
                shards, first = array_shards(f, shard_bytes)
            else:
                shards = [(a, b, line, line) for a, b, line in line_shards(f, shard_bytes, at_blank_line=False)]
                first = _first_line_record(f)
            self.index += [(f, *s) for s in shards]
            if first is not None:
                self.formats[f] = (self._file_format(_as_record(*first), first[1]), first[1])
        self.num_shards = len(self.index)

    def _file_format(self, record: dict[str, Any], where: str) -> str:
        if self.record_format is not None:
            return self.record_format
        fmt = detect(record, self.fields)
        if fmt is None:
            raise self._missing(record, where, "messages", where)
        return fmt

    def _missing(self, record: dict[str, Any], where: str, fmt: str, first: str) -> DataError:
        """A record without the fields of its file's format: which fields, and what to change."""
        wanted = REQUIRED.get(fmt, self.fields)
        if self.record_format is not None:
            fix = (f"record_format is {fmt!r}, so give every record those fields or set record_format to the "
                   "records' format")
        elif where != first:
            fix = f"{first} is {NAMES[fmt]} record, so give every record of the file those fields"
        else:
            fix = ("set text_field or messages_field to the one holding the documents, or write Alpaca "
                   "(instruction, output) or ShareGPT (conversations) records")
        return DataError(f"{where} has no {' or '.join(map(repr, wanted))} field (its fields are: "
                         f"{', '.join(record) or 'none'}); {fix}.")

    def _document(self, record: dict[str, Any], where: str, path: Path) -> Document | None:
        """The record as a document: Alpaca and ShareGPT records become messages chats."""
        fmt, first = self.formats[path]
        if not fits(record, fmt, self.fields):
            other = None if self.record_format is not None else detect(record, self.fields)
            if other is not None:
                raise DataError(f"{where} is {NAMES[other]} record but {first} is {NAMES[fmt]} record; a file "
                                "holds one record format, so split it into one file per format.")
            raise self._missing(record, where, fmt, first)
        if fmt != "messages":
            return to_chat(record, where, fmt)
        key = next(k for k in self.fields if k in record)
        return as_document(record[key], where, key, chat=key == self.messages_field)

    def read_shard(self, index: int) -> list[Doc]:
        path, start, end, first, line = self.index[index]
        records = (array_records(path, start, end, first, line) if path in self.arrays
                   else _line_records(path, start, end, line))
        docs = []
        for value, where in records:
            document = self._document(_as_record(value, where), where, path)
            if document is not None:
                docs.append(Doc(document, where))
        return docs


__all__ = ["JsonlSource"]
