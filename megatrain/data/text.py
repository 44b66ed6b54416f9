"""Plain-text files as a source: documents are paragraphs (separated by blank lines) or whole files."""

from __future__ import annotations

import re
from pathlib import Path

from megatrain.data.byte_ranges import line_shards, read_range
from megatrain.data.documents import Doc, Source

_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class TextSource(Source):
    def __init__(self, files: list[Path], shard_bytes: int, split: str):
        self.name, self.files, self.split = str(files[0].parent if len(files) > 1 else files[0]), files, split
        if split == "file":
            self.index = [(f, 0, f.stat().st_size, 1) for f in files]
        else:
            self.index = [(f, *s) for f in files for s in line_shards(f, shard_bytes, at_blank_line=True)]
        self.num_shards = len(self.index)

    def read_shard(self, index: int) -> list[Doc]:
        path, start, end, first_line = self.index[index]
        text = read_range(path, start, end).decode("utf-8", errors="replace")
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


__all__ = ["TextSource"]
