"""Shards of a text file as byte ranges: cut after about shard_bytes at a line end, and read back on their own."""

from __future__ import annotations

from pathlib import Path


def line_shards(path: Path, shard_bytes: int, at_blank_line: bool) -> list[tuple[int, int, int]]:
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


def read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


__all__ = ["line_shards", "read_range"]
