"""Sources of documents, the eval split, and a resumable, shuffled, multi-epoch document stream.

A document is text (`str`), a chat (`list` of `{"role", "content"}` dicts, the `messages` format) or
pre-tokenized ids (`list[int]`). Sources:

- synthetic: the default, no files. Seeded, learnable documents (see `synthetic_document`).
- text (.txt .text .md, or any file with format="text"): documents are paragraphs separated by blank lines
  (text_split="paragraph"), or whole files (text_split="file").
- jsonl (.jsonl .ndjson .json): one JSON object per line (blank lines are skipped), or a file holding one JSON
  array of objects. A record's document is its `messages_field` (a chat) or its `text_field` (text or token
  ids), or it is an Alpaca or ShareGPT record, converted to a chat (formats.py). The record format is detected
  per file from its first record (or set with `record_format`); every other record of the file must fit it.
- parquet (.parquet .pq) and arrow (.arrow .feather .ipc .arrows, Arrow IPC file or stream format): one
  column (`column`, else `text_field`, else `messages_field`) of strings, token-id lists or message lists; or,
  detected from the column names as a first JSON record is (or set with `record_format`), each row an Alpaca
  or ShareGPT record.
A folder is read as all its files of one format, in sorted path order.

Every source is cut into shards that can be read on their own, so nothing is ever read whole: a Parquet row
group, an Arrow record batch, about `shard_bytes` of a text/JSONL file cut at a line (text: a blank line) or
of a JSON array cut between elements, a whole file with text_split="file", or 100 synthetic documents. The
shard index is built when the source is opened (one pass over text/JSON files, parsing each element of a JSON
array once, one at a time; metadata only for Parquet/Arrow).

Shuffling is two-level: the shard order is permuted per epoch, then the documents inside each shard. A
position is therefore (epoch, shard slot, document slot): three integers from which a stream resumes
exactly, re-reading one shard.
"""

from __future__ import annotations

import codecs
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from megatrain.data.formats import FIELDS, NAMES, REQUIRED, check_entries, detect, fits, to_chat
from megatrain.data.tokenizers import DataError, Message

if TYPE_CHECKING:
    from megatrain.data.loader import DataConfig

Document = str | list[Message] | list[int]

EXTENSIONS = {
    "text": (".txt", ".text", ".md"),
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "parquet": (".parquet", ".pq"),
    "arrow": (".arrow", ".feather", ".ipc", ".arrows"),
}
FORMATS = ("synthetic", *EXTENSIONS)
_EVAL_SEED = 0x5EED  # the eval split ignores the shuffle seed: changing the seed never leaks eval into train


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


# ---- synthetic ----

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


# ---- text and JSON Lines: shards are byte ranges cut at line boundaries ----

def _line_shards(path: Path, shard_bytes: int, at_blank_line: bool) -> list[tuple[int, int, int]]:
    """(start byte, end byte, first line number) of each shard: cut after about shard_bytes, at a line end
    (at_blank_line: after a blank line, so paragraphs never straddle shards)."""
    shards, start, first_line, pos = [], 0, 1, 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            pos += len(line)
            if pos - start >= shard_bytes and (not at_blank_line or not line.strip()):
                shards.append((start, pos, first_line))
                start, first_line = pos, n + 1
    if pos > start:
        shards.append((start, pos, first_line))
    return shards


def _read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class TextSource(Source):
    def __init__(self, files: list[Path], shard_bytes: int, split: str):
        self.name, self.files, self.split = str(files[0].parent if len(files) > 1 else files[0]), files, split
        if split == "file":
            self.index = [(f, 0, f.stat().st_size, 1) for f in files]
        else:
            self.index = [(f, *s) for f in files for s in _line_shards(f, shard_bytes, at_blank_line=True)]
        self.num_shards = len(self.index)

    def read_shard(self, index: int) -> list[Doc]:
        path, start, end, first_line = self.index[index]
        text = _read_range(path, start, end).decode("utf-8", errors="replace")
        if self.split == "file":
            return [Doc(text, str(path))] if text.strip() else []
        docs, last, line = [], 0, first_line  # `line` is the line number of text[last]
        for m in [*_BLANK_LINE.finditer(text), None]:
            segment = text[last : m.start() if m else len(text)]
            para = segment.strip("\r\n")
            if para.strip():
                skipped = segment[: len(segment) - len(segment.lstrip("\r\n"))]
                docs.append(Doc(para, f"{path} line {line + skipped.count(chr(10))}"))
            if m:
                line += text.count("\n", last, m.end())
                last = m.end()
        return docs


# ---- JSON: JSON Lines (shards cut at line ends) and JSON arrays (shards cut between elements) ----

_UTF8_BOM = b"\xef\xbb\xbf"
_NOT_SPACE = re.compile(r"[^ \t\n\r]")
_BETWEEN_ELEMENTS = re.compile(r"[ \t\n\r,]*")
_READ_BYTES = 1 << 20
# json reports a value cut by the end of a read as an error at most a few characters before that end (a cut
# literal, number or \\u escape) or as an unterminated string; anything else is a real syntax error
_CUT_VALUE_CHARS = 16


def _is_json_array(path: Path) -> bool:
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


def _array_shards(path: Path, shard_bytes: int) -> tuple[list[tuple[int, int, int, int]], tuple[Any, str] | None]:
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


def _array_records(path: Path, start: int, end: int, record: int, line: int) -> Iterator[tuple[Any, str]]:
    """The elements of one shard of a JSON array file (already parsed once when it was indexed)."""
    text = _read_range(path, start, end).decode("utf-8")
    decoder, pos = json.JSONDecoder(), 0
    while (begin := _BETWEEN_ELEMENTS.match(text, pos).end()) < len(text):
        line += text.count("\n", pos, begin)
        value, pos = decoder.raw_decode(text, begin)
        yield value, _array_where(path, record, line)
        line += text.count("\n", begin, pos)
        record += 1


def _parse_line(raw: bytes, where: str, fix: str = "fix or remove that line") -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise DataError(f"{where} is not valid JSON ({detail}); {fix}.") from None


def _line_records(path: Path, start: int, end: int, first_line: int) -> Iterator[tuple[Any, str]]:
    for j, raw in enumerate(_read_range(path, start, end).split(b"\n")):
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
            if _is_json_array(f):
                self.arrays.add(f)
                shards, first = _array_shards(f, shard_bytes)
            else:
                shards = [(a, b, line, line) for a, b, line in _line_shards(f, shard_bytes, at_blank_line=False)]
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
        records = (_array_records(path, start, end, first, line) if path in self.arrays
                   else _line_records(path, start, end, line))
        docs = []
        for value, where in records:
            document = self._document(_as_record(value, where), where, path)
            if document is not None:
                docs.append(Doc(document, where))
        return docs


# ---- Parquet and Arrow IPC: shards are row groups / record batches, one column read at a time ----

@dataclass(frozen=True)
class _Columns:
    """How one Parquet / Arrow file is read: one messages/text column, or the columns of Alpaca / ShareGPT
    records (each row read as a record, as a JSON line is)."""

    format: str
    names: list[str]
    chat: bool = False  # messages format: the column holds chats


def _pick_columns(names: list[str], path: Path, column: str | None, text_field: str, messages_field: str,
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


def _batch_docs(batch: Any, path: Path, columns: _Columns, first_row: int) -> list[Doc]:
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


class ParquetSource(Source):
    def __init__(self, files: list[Path], column: str | None, text_field: str, messages_field: str,
                 record_format: str | None = None, prefer_text: bool = False):
        import pyarrow.parquet as pq

        self.name, self.index = str(files[0].parent if len(files) > 1 else files[0]), []
        self.columns: dict[Path, _Columns] = {}
        for f in files:
            try:
                pf = pq.ParquetFile(f)
            except Exception as e:
                raise DataError(f"{f} is not a readable Parquet file ({e}); re-export it.") from None
            meta = pf.metadata
            self.columns[f] = _pick_columns(pf.schema_arrow.names, f, column, text_field, messages_field,
                                            record_format, prefer_text)
            first = 0
            for g in range(meta.num_row_groups):
                self.index.append((f, g, first))
                first += meta.row_group(g).num_rows
        self.num_shards = len(self.index)

    def read_shard(self, index: int) -> list[Doc]:
        import pyarrow.parquet as pq

        path, group, first_row = self.index[index]
        columns, docs, row = self.columns[path], [], first_row
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, row_groups=[group], columns=columns.names):
            docs += _batch_docs(batch, path, columns, row)
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


class ArrowSource(Source):
    def __init__(self, files: list[Path], column: str | None, text_field: str, messages_field: str,
                 record_format: str | None = None, prefer_text: bool = False):
        self.name, self.index = str(files[0].parent if len(files) > 1 else files[0]), []
        self.columns: dict[Path, _Columns] = {}
        for f in files:
            reader, is_file = _open_arrow(f)
            self.columns[f] = _pick_columns(reader.schema.names, f, column, text_field, messages_field,
                                            record_format, prefer_text)
            # the stream format has no footer: count its batches (and rows) by reading them one at a time
            sizes = ([reader.get_batch(i).num_rows for i in range(reader.num_record_batches)] if is_file
                     else [b.num_rows for b in reader])
            first = 0
            for b, n in enumerate(sizes):
                self.index.append((f, b, first))
                first += n
        self.num_shards = len(self.index)

    def read_shard(self, index: int) -> list[Doc]:
        path, b, first_row = self.index[index]
        reader, is_file = _open_arrow(path)
        if is_file:
            batch = reader.get_batch(b)
        else:
            for i, batch in enumerate(reader):  # noqa: B007 (stop at the b-th batch)
                if i == b:
                    break
        return _batch_docs(batch, path, self.columns[path], first_row)


# ---- documents ----

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


# ---- opening a source ----

def _data_files(path: Path, fmt: str | None) -> tuple[str, list[Path]]:
    if path.is_file():
        if fmt is None:
            fmt = next((k for k, exts in EXTENSIONS.items() if path.name.lower().endswith(exts)), None)
            if fmt is None:
                raise DataError(f"cannot tell the format of {path} from its extension; set format to one of "
                                f"{', '.join(EXTENSIONS)}.")
        files = [path]
    else:
        candidates = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
        if not candidates:
            raise DataError(f"folder {path} is empty; point source at a folder with data files.")
        by_format = {k: [p for p in candidates if p.name.lower().endswith(exts)]
                     for k, exts in EXTENSIONS.items()}
        if fmt is None:
            found = [k for k, ps in by_format.items() if ps]
            if len(found) > 1:
                raise DataError(f"folder {path} holds {' and '.join(found)} files; set format to the one to "
                                "read.")
            if not found:
                known = " ".join(e for exts in EXTENSIONS.values() for e in exts)
                raise DataError(f"folder {path} holds no data files (looked for {known}); point source at a "
                                "folder with data or set format.")
            fmt = found[0]
        files = by_format[fmt] or candidates  # an explicit format reads files of any extension if none match
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise DataError(f"{path} is empty; point source at a file or folder with data.")
    return fmt, files


def find_data_files(cfg: DataConfig) -> tuple[str, list[Path]]:
    """The format (detected or cfg.format) and the non-empty files of a file or folder source ("synthetic" and
    none for the synthetic source). Cheap (no file is read), so a driver can check a source before it starts
    anything."""
    if cfg.source == "synthetic" or cfg.format == "synthetic":
        return "synthetic", []
    path = Path(cfg.source)
    if not path.exists():
        raise DataError(f"data source {path} does not exist; pass an existing file or folder, or "
                        "source='synthetic'.")
    return _data_files(path, cfg.format)


def open_source(cfg: DataConfig) -> tuple[str, Source]:
    """The format (detected or cfg.format) and the source it names."""
    fmt, files = find_data_files(cfg)
    if fmt == "synthetic":
        return fmt, SyntheticSource(cfg.synthetic_docs, cfg.seed)
    if fmt == "text":
        if cfg.record_format is not None:  # plain text has no records: a forced format is a mistaken config
            raise DataError(f"record_format applies to JSON, JSON Lines, Parquet and Arrow files but {cfg.source} "
                            "is text; unset record_format, or set format to the data's.")
        return fmt, TextSource(files, cfg.shard_bytes, cfg.text_split)
    if fmt == "jsonl":
        return fmt, JsonlSource(files, cfg.shard_bytes, cfg.text_field, cfg.messages_field, cfg.sft is False,
                                cfg.record_format)
    columnar = (cfg.column, cfg.text_field, cfg.messages_field, cfg.record_format, cfg.sft is False)
    return fmt, (ParquetSource if fmt == "parquet" else ArrowSource)(files, *columnar)


# ---- eval split and the document stream ----

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


class DocumentStream:
    """Training documents, shuffled per epoch, for `epochs` epochs (None: forever), from an exact position."""

    def __init__(self, source: Source, split: EvalSplit, seed: int = 0, shuffle: bool = True,
                 epochs: int | None = None):
        self.source, self.split, self.seed, self.shuffle, self.epochs = source, split, seed, shuffle, epochs
        self.epoch = self.shard = self.doc = 0
        self._cache: tuple[tuple[int, int], list[Doc]] | None = None
        self._empty_epoch = False  # True while an epoch read from its start has yielded nothing yet

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "doc": self.doc}

    def seek(self, position: dict[str, int]) -> None:
        self.epoch, self.shard, self.doc = (int(position[k]) for k in ("epoch", "shard", "doc"))
        self._empty_epoch = False

    def _shard_docs(self) -> list[Doc]:
        key = (self.epoch, self.shard)
        if self._cache is None or self._cache[0] != key:
            order = np.arange(self.source.num_shards)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            sid = int(order[self.shard])
            docs = self.source.read_shard(sid)
            keep = np.flatnonzero(~self.split.is_eval(sid, len(docs)))
            if self.shuffle:
                keep = np.random.default_rng([self.seed, self.epoch, sid]).permutation(keep)
            self._cache = (key, [docs[i] for i in keep])
        return self._cache[1]

    def __iter__(self) -> DocumentStream:
        return self

    def __next__(self) -> Doc:
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                raise StopIteration
            if self.shard == 0 and self.doc == 0:
                self._empty_epoch = True
            docs = self._shard_docs()
            if self.doc < len(docs):
                self.doc += 1
                self._empty_epoch = False
                return docs[self.doc - 1]
            self.shard, self.doc = self.shard + 1, 0
            if self.shard == self.source.num_shards:
                if self._empty_epoch:
                    raise DataError(f"{self.source.name} has no training documents left after the eval "
                                    "split; lower eval_fraction or eval_count, or add data.")
                self.epoch, self.shard = self.epoch + 1, 0


__all__ = [
    "ArrowSource", "Doc", "Document", "DocumentStream", "EvalSplit", "FORMATS", "JsonlSource",
    "ParquetSource", "Source", "SyntheticSource", "TextSource", "as_document", "find_data_files", "open_source",
    "synthetic_document",
]
