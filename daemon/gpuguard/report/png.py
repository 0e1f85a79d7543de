"""A Figure as a PNG, drawn in pure Python (zlib + struct): the same panels, lines,
limits and event markers as the SVG at the same pixel positions, for chat messages and
tickets where an HTML file does not travel."""
from __future__ import annotations

import struct
import zlib

from gpuguard.report import font
from gpuguard.report.figure import SEVERITY_COLOUR, Figure

HEADER_H = 24


def _rgb(colour: str) -> tuple[int, int, int]:
    c = colour.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


class Canvas:
    def __init__(self, width: int, height: int, background: tuple[int, int, int] = (255, 255, 255)) -> None:
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def get(self, x: int, y: int) -> tuple[int, int, int]:
        i = (y * self.w + x) * 3
        return self.px[i], self.px[i + 1], self.px[i + 2]

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int]) -> None:
        row = bytes(c) * max(0, x1 - x0)
        for y in range(max(0, y0), min(self.h, y1)):
            i = (y * self.w + max(0, x0)) * 3
            self.px[i:i + len(row)] = row[: (min(self.w, x1) - max(0, x0)) * 3]

    def line(self, x0: float, y0: float, x1: float, y1: float, c: tuple[int, int, int], dash: int = 0,
             width: int = 1, phase: int = 0) -> int:
        """Bresenham on rounded ends; `dash` = on/off run length in pixels, `phase` where
        in the dash pattern to start (returned at the end, so a polyline's dashes run on)."""
        x0i, y0i, x1i, y1i = round(x0), round(y0), round(x1), round(y1)
        dx, dy = abs(x1i - x0i), -abs(y1i - y0i)
        sx, sy = (1 if x0i < x1i else -1), (1 if y0i < y1i else -1)
        err = dx + dy
        n = phase
        while True:
            if not dash or (n // dash) % 2 == 0:
                self.set(x0i, y0i, c)
                if width > 1:
                    self.set(x0i, y0i + 1, c)
            if x0i == x1i and y0i == y1i:
                return n
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0i += sx
            if e2 <= dx:
                err += dx
                y0i += sy
            n += 1

    def text(self, x: float, y: float, s: str, c: tuple[int, int, int], anchor: str = "start") -> None:
        """`y` is the baseline, as in SVG."""
        w = font.text_width(s)
        x0 = round(x - (w if anchor == "end" else w / 2 if anchor == "middle" else 0))
        top = round(y) - font.HEIGHT
        for k, ch in enumerate(s):
            for gy, row in enumerate(font.glyph(ch)):
                for gx, bit in enumerate(row):
                    if bit == "#":
                        self.set(x0 + k * font.ADVANCE + gx, top + gy, c)

    def encode(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def render_png(fig: Figure, title: str = "") -> bytes:
    """PNG bytes. The figure sits below a `HEADER_H` title strip: panel i's plot box is
    `fig.panel_box(i)` shifted down by HEADER_H."""
    cv = Canvas(fig.width, fig.height + HEADER_H)
    grey, light, dark = (204, 204, 204), (232, 232, 232), (34, 34, 34)
    cv.text(8, 16, title[:150], dark)
    ticks = fig.time_ticks()
    for i, p in enumerate(fig.panels):
        left, top, right, bottom = fig.panel_box(i)
        top, bottom = top + HEADER_H, bottom + HEADER_H
        cv.rect(int(left), int(top), int(right), int(bottom), (250, 250, 250))
        for yv in p.ticks():
            y = fig.y(i, yv) + HEADER_H
            cv.line(left, y, right, y, light)
            cv.text(left - 4, y + 3, f"{yv:g}", dark, anchor="end")
        for t, label in ticks:
            x = fig.x(t)
            cv.line(x, top, x, bottom, light)
            cv.text(x, bottom + 11, label, dark, anchor="middle")
        for edge in ((left, top, right, top), (left, bottom, right, bottom), (left, top, left, bottom),
                     (right, top, right, bottom)):
            cv.line(*edge, grey)
        cv.text(left, top - 6, f"{p.title} ({p.unit})", dark)
        lx = left + font.text_width(f"{p.title} ({p.unit})") + 16
        for m in fig.markers:
            if fig.t0 <= m.t <= fig.t1:
                x = fig.x(m.t)
                cv.line(x, top, x, bottom, _rgb(SEVERITY_COLOUR.get(m.severity, "#888888")), dash=3)
        for s in p.series:
            colour = _rgb(s.colour)
            prev = None
            phase = 0
            for t, v in zip(s.t, s.v):
                if v is None:
                    prev = None
                    continue
                pt = (fig.x(t), fig.y(i, v) + HEADER_H)
                if prev is not None:
                    phase = cv.line(prev[0], prev[1], pt[0], pt[1], colour, dash=4 if s.dashed else 0, width=2,
                                    phase=phase)
                else:
                    cv.set(round(pt[0]), round(pt[1]), colour)
                prev = pt
            cv.text(lx, top - 6, s.label, colour)
            lx += font.text_width(s.label) + 12
    if fig.focus is not None and fig.t0 <= fig.focus <= fig.t1:
        x = fig.x(fig.focus)
        cv.line(x, HEADER_H, x, fig.height + HEADER_H - 1, (176, 0, 32))
    return cv.encode()


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of a PNG this module wrote (filter 0, RGB 8-bit): lets a
    test read pixels back without an imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, w, h, idat = 8, 0, 0, b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * 3 + 1
    return w, h, b"".join(raw[y * stride + 1:(y + 1) * stride] for y in range(h))
