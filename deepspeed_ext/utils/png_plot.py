"""A dependency-free line plot written as a PNG (loss curves without matplotlib)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

Color = tuple[int, int, int]


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def write_png(path: str, pixels: list[bytearray], width: int, height: int) -> None:
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)  # filter type 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(_chunk(b"IHDR", header))
        f.write(_chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(_chunk(b"IEND", b""))


def line_plot(
    path: str,
    series: Sequence[Sequence[float]],
    colors: Sequence[Color] = ((31, 119, 180), (214, 39, 40)),
    width: int = 640,
    height: int = 400,
    margin: int = 30,
) -> None:
    """Plots each series against its index, sharing axes; grid lines at quarter ranges."""
    px = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def put(x: int, y: int, c: Color) -> None:
        if 0 <= x < width and 0 <= y < height:
            px[y][3 * x : 3 * x + 3] = bytes(c)

    def line(x0: int, y0: int, x1: int, y1: int, c: Color) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            put(x0, y0, c)
            put(x0, y0 + 1, c)  # 2 px thick
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    values = [v for s in series for v in s]
    lo, hi = min(values), max(values)
    hi = hi if hi > lo else lo + 1.0
    n = max(len(s) for s in series)
    w, h = width - 2 * margin, height - 2 * margin
    for i in range(5):  # grid
        y = margin + i * h // 4
        line(margin, y, width - margin, y, (225, 225, 225))
        x = margin + i * w // 4
        line(x, margin, x, height - margin, (225, 225, 225))
    line(margin, height - margin, width - margin, height - margin, (0, 0, 0))
    line(margin, margin, margin, height - margin, (0, 0, 0))
    for k, s in enumerate(series):
        pts = [
            (margin + i * w // max(1, n - 1), margin + int((hi - v) / (hi - lo) * h))
            for i, v in enumerate(s)
        ]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            line(x0, y0, x1, y1, colors[k % len(colors)])
    write_png(path, px, width, height)
