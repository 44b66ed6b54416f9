"""A PNG writer and a 5x7 bitmap font: enough to draw a timeline without an imaging library."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def png_bytes(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of a uint8 [H, W, 3] array: every row with filter type 0 (none), one IDAT."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] array, got {image.dtype} {list(image.shape)}")
    h, w, _ = image.shape
    raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # column 0: the filter byte of each scanline
    raw[:, 1:] = image.reshape(h, 3 * w)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # bit depth 8, colour type 2 (RGB), no interlace
    return (PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
            + _chunk(b"IEND", b""))


def write_png(image: np.ndarray, path: str | os.PathLike) -> None:
    Path(path).write_bytes(png_bytes(image))


# 5x7 glyphs, rows top to bottom; lower case is drawn as upper case.
_GLYPHS = {
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "####. #...# #...# #...# #...# #...# ####.",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    " ": "..... ..... ..... ..... ..... ..... .....", ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...", "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....", "-": "..... ..... ..... ##### ..... ..... .....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....", "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "_": "..... ..... ..... ..... ..... ..... #####", "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...", "=": "..... ..... ##### ..... ##### ..... .....",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
}
FONT = {c: np.array([[p == "#" for p in row] for row in g.split()], dtype=bool) for c, g in _GLYPHS.items()}
GLYPH_W, GLYPH_H = 5, 7


def text_width(text: str, scale: int = 1) -> int:
    return max(len(text) * (GLYPH_W + 1) - 1, 0) * scale


def draw_text(image: np.ndarray, x: int, y: int, text: str, color: tuple[int, int, int],
              scale: int = 1) -> None:
    """Draws `text` with its top-left corner at (x, y); pixels outside the image are dropped."""
    h, w, _ = image.shape
    for i, ch in enumerate(text.upper()):
        glyph = FONT.get(ch, FONT["?"])
        if scale > 1:
            glyph = glyph.repeat(scale, 0).repeat(scale, 1)
        x0 = x + i * (GLYPH_W + 1) * scale
        gy0, gx0 = max(0, -y), max(0, -x0)
        gy1, gx1 = min(glyph.shape[0], h - y), min(glyph.shape[1], w - x0)
        if gy1 <= gy0 or gx1 <= gx0:
            continue
        region = image[y + gy0:y + gy1, x0 + gx0:x0 + gx1]
        region[glyph[gy0:gy1, gx0:gx1]] = color


def fill_rect(image: np.ndarray, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
    """Fills [x0, x1) x [y0, y1), clipped to the image."""
    h, w, _ = image.shape
    x0, x1, y0, y1 = max(x0, 0), min(x1, w), max(y0, 0), min(y1, h)
    if x1 > x0 and y1 > y0:
        image[y0:y1, x0:x1] = color
