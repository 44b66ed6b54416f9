"""Files holding one JSON array of records, read element by element: the scan that cuts them into shards
between elements, and the reading back of one shard."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from megatrain.data.byte_ranges import read_range
from megatrain.data.tokenizers import DataError

_UTF8_BOM = b"\xef\xbb\xbf"
_NOT_SPACE = re.compile(r"[^ \t\n\r]")
_BETWEEN_ELEMENTS = re.compile(r"[ \t\n\r,]*")
_READ_BYTES = 1 << 20
# json reports a value cut by the end of a read as an error at most a few characters before that end (a cut
# literal, number or \\u escape) or as an unterminated string; anything else is a real syntax error
_CUT_VALUE_CHARS = 16


def is_json_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).removeprefix(_UTF8_BOM).lstrip().startswith(b"[")


def _array_where(path: Path, record: int, line: int) -> str:
    return f"{path} record {record} (line {line})"


class _ArrayScanner:
    """The elements of a file holding one JSON array, parsed one at a time from 1 MiB reads: the json module
    has no streaming parser, and a ShareGPT export can be gigabytes while each record is small.

    Iterating yields (start byte, end byte, line, record number from 1, value) per element."""

    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.eof = "", 0, False
        self.byte, self.line = 0, 1  # of text[pos]
        if f.read(3) == _UTF8_BOM:
            self.byte = 3
        else:
            f.seek(0)

    def _fill(self) -> bool:
        """Reads on (dropping what is behind pos); False at the end of the file."""
        if self.eof:
            return False
        chunk = self.f.read(_READ_BYTES)
        self.eof = not chunk
        try:
            self.text = self.text[self.pos :] + self.utf8.decode(chunk, final=self.eof)
        except UnicodeDecodeError:
            raise DataError(f"{self.path} is not UTF-8 text (after line {self.line}); re-encode it as "
                            "UTF-8.") from None
        self.pos = 0
        return not self.eof

    def _advance(self, to: int) -> None:
        self.byte += len(self.text[self.pos : to].encode("utf-8"))
        self.line += self.text.count("\n", self.pos, to)
        self.pos = to

    def _peek(self) -> str | None:
        """The next character that is not white space (pos moved to it); None at the end of the file."""
        while True:
            m = _NOT_SPACE.search(self.text, self.pos)
            if m:
                self._advance(m.start())
                return self.text[self.pos]
            self._advance(len(self.text))
            if not self._fill():
                return None

    def _fail(self, what: str, line: int | None = None) -> DataError:
        return DataError(f"{self.path} is not a valid JSON array ({what} at line {line or self.line}); fix the "
                         "file, or write one JSON object per line (JSON Lines).")

    def _value(self) -> tuple[Any, int]:
        """The value at pos and where it ends, reading on while the read so far cuts it."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or len(self.text) - e.pos <= _CUT_VALUE_CHARS
                if cut and self._fill():
                    continue
                what = e.msg.removesuffix(" at")  # "Invalid control character at": the line follows here
                raise self._fail(what, self.line + self.text.count("\n", self.pos, e.pos)) from None
            if end < len(self.text) or not self._fill():  # a number ending the read may go on in the next
                return value, end

    def __iter__(self) -> Iterator[tuple[int, int, int, int, Any]]:
        self._peek()
        self._advance(self.pos + 1)  # the "[" (the caller saw it)
        if self._peek() == "]":
            return
        record = 0
        while True:
            start, line = self.byte, self.line
            value, end = self._value()
            self._advance(end)
            record += 1
            yield start, self.byte, line, record, value
            after = self._peek()
            if after not in (",", "]"):
                raise self._fail("expected ',' or ']' after an element" if after else "the array is not closed")
            self._advance(self.pos + 1)
            if after == "]":
                if self._peek() is not None:
                    raise self._fail("text after the array")
                return
            if self._peek() == "]":
                raise self._fail("a comma before ']'")


def array_shards(path: Path, shard_bytes: int) -> tuple[list[tuple[int, int, int, int]], tuple[Any, str] | None]:
    """(start byte, end byte, first record, its line) of each shard of a JSON array file, cut after about
    shard_bytes between elements; and the first record with its place (None for an empty array)."""
    shards: list[tuple[int, int, int, int]] = []
    first: tuple[Any, str] | None = None
    open_shard: tuple[int, int, int] | None = None  # (start byte, first record, its line) of the shard being cut
    end = 0
    with open(path, "rb") as f:
        for start, end, line, record, value in _ArrayScanner(f, path):
            if first is None:
                first = (value, _array_where(path, record, line))
            if open_shard is None:
                open_shard = (start, record, line)
            if end - open_shard[0] >= shard_bytes:
                shards.append((open_shard[0], end, *open_shard[1:]))
                open_shard = None
    if open_shard is not None:
        shards.append((open_shard[0], end, *open_shard[1:]))
    return shards, first


def array_records(path: Path, start: int, end: int, record: int, line: int) -> Iterator[tuple[Any, str]]:
    """The elements of one shard of a JSON array file (already parsed once when it was indexed)."""
    text = read_range(path, start, end).decode("utf-8")
    decoder, pos = json.JSONDecoder(), 0
    while (begin := _BETWEEN_ELEMENTS.match(text, pos).end()) < len(text):
        line += text.count("\n", pos, begin)
        value, pos = decoder.raw_decode(text, begin)
        yield value, _array_where(path, record, line)
        line += text.count("\n", begin, pos)
        record += 1


__all__ = ["array_records", "array_shards", "is_json_array"]
