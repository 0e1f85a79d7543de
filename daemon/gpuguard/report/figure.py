"""What a report plots, independent of how it is drawn: panels (one quantity of one GPU
or of the engines), their series, y scales, limit lines and the event markers that run
through every panel at the same x. The SVG and PNG renderers draw the same Figure with the
same geometry, so a point in one sits where it sits in the other.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from gpuguard.report.history import Window

# Okabe–Ito: tells series apart for colour-blind readers too.
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#f0e442", "#000000")
SEVERITY_COLOUR = {"critical": "#b00020", "alert": "#d55e00", "warning": "#e69f00", "info": "#888888"}

# Geometry in pixels (SVG user units = PNG pixels).
WIDTH = 960
PANEL_H = 130
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 22, 22


@dataclass(frozen=True)
class Series:
    name: str  # "xtx-0 power_w": the recorder column it comes from
    label: str  # legend text
    colour: str
    t: tuple[float, ...]
    v: tuple[float | None, ...]  # None = not read (lost GPU): a gap in the line
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    series: tuple[Series, ...]
    y0: float
    y1: float

    def ticks(self) -> list[float]:
        return nice_ticks(self.y0, self.y1)


@dataclass(frozen=True)
class Marker:
    t: float
    severity: str
    label: str  # kind
    event_id: int | None = None


@dataclass(frozen=True)
class Figure:
    t0: float
    t1: float
    focus: float | None
    panels: tuple[Panel, ...]
    markers: tuple[Marker, ...] = ()
    width: int = WIDTH
    panel_height: int = PANEL_H

    @property
    def height(self) -> int:
        return self.panel_height * len(self.panels)

    # -- geometry shared by the renderers ---------------------------------------------
    def x(self, t: float) -> float:
        span = (self.t1 - self.t0) or 1.0
        return LEFT + (t - self.t0) / span * (self.width - LEFT - RIGHT)

    def panel_box(self, i: int) -> tuple[float, float, float, float]:
        """left, top, right, bottom of panel i's plot area."""
        top = i * self.panel_height + TOP
        return LEFT, top, self.width - RIGHT, (i + 1) * self.panel_height - BOTTOM

    def y(self, i: int, v: float) -> float:
        p = self.panels[i]
        _, top, _, bottom = self.panel_box(i)
        span = (p.y1 - p.y0) or 1.0
        return bottom - (v - p.y0) / span * (bottom - top)

    def time_ticks(self) -> list[tuple[float, str]]:
        """Ticks relative to the focus (`-1:00`, `0`, `+0:30`) when there is one, else clock."""
        span = self.t1 - self.t0
        step = next((s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600)
                     if span / s <= 10), 86400)
        ref = self.focus if self.focus is not None else 0.0
        first = math.ceil((self.t0 - ref) / step) * step + ref
        out = []
        t = first
        while t <= self.t1 + 1e-9:
            if self.focus is None:
                label = time.strftime("%H:%M:%S", time.localtime(t))
            else:
                d = round(t - self.focus)
                label = "0" if d == 0 else f"{'+' if d > 0 else '-'}{abs(d) // 60}:{abs(d) % 60:02d}"
            out.append((t, label))
            t += step
        return out


def nice_ticks(y0: float, y1: float, n: int = 4) -> list[float]:
    span = y1 - y0
    if span <= 0:
        return [y0]
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(y0 / step) * step
    return [round(first + i * step, 10) for i in range(int((y1 - first) / step + 1e-9) + 1)]


def _range(values: list[float], floor_zero: bool = True, extra: tuple[float, ...] = ()) -> tuple[float, float]:
    vals = [v for v in values if v is not None] + list(extra)
    if not vals:
        return 0.0, 1.0
    lo, hi = min(vals), max(vals)
    if floor_zero:
        lo = min(0.0, lo)
    if hi - lo < 1e-9:
        hi = lo + 1.0
    ticks = nice_ticks(lo, hi * 1.05 if hi > 0 else hi + 1)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    return (lo, math.ceil(hi / step) * step if hi > 0 else hi)


def _scaled(vs: list, k: float) -> tuple:
    return tuple(None if v is None else v * k for v in vs)


# name, label, scale, unit per quantity; each GPU gets one panel per quantity
GPU_PANELS: tuple[tuple[str, str, tuple[tuple[str, str, float, bool], ...]], ...] = (
    ("power", "W", (("power_w", "power", 1.0, False), ("cap_w", "cap", 1.0, True))),
    ("temperature", "°C", (("edge_c", "edge", 1.0, False), ("junction_c", "junction", 1.0, False),
                           ("mem_c", "memory", 1.0, False))),
    ("clocks", "MHz", (("sclk_hz", "sclk", 1e-6, False), ("mclk_hz", "mclk", 1e-6, False))),
    ("fan and busy", "rpm / %", (("fan_rpm", "fan rpm", 1.0, False), ("busy", "busy %", 100.0, True))),
)


def total_power(window: Window, stale: float = 10.0) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The host's GPU draw per poll: each GPU is read at its own instant within a poll, so
    rows are grouped into polls (a poll holds each GPU once) and the total is the sum of
    every GPU's latest reading at the end of the poll. A GPU not read for `stale` seconds,
    or whose power could not be read, adds nothing."""
    rows = sorted((t, gpu, v) for gpu, g in window.gpus.items() for t, v in zip(g["t"], g["power_w"]))
    latest: dict[str, tuple[float, float | None]] = {}
    ts: list[float] = []
    totals: list[float] = []
    in_poll: set[str] = set()

    def close(at: float) -> None:
        ts.append(at)
        totals.append(sum(v for t, v in latest.values() if v is not None and at - t <= stale))

    for i, (t, gpu, v) in enumerate(rows):
        if gpu in in_poll:
            close(rows[i - 1][0])
            in_poll = set()
        in_poll.add(gpu)
        latest[gpu] = (t, v)
    if rows:
        close(rows[-1][0])
    return tuple(ts), tuple(totals)


def build_figure(window: Window, focus: float | None = None, gpu_limits: dict[str, dict[str, float]] | None = None) -> Figure:
    """One panel per GPU and quantity, then the engines' tokens/s and no-progress seconds.
    `gpu_limits` (gpu -> {"edge_c": crit, ...}) stretches a scale to show a limit."""
    panels: list[Panel] = []
    if len(window.gpus) > 1:
        # INCIDENTS §2: each card alone was fine; the two together tripped the PSU.
        series = []
        for j, gpu in enumerate(sorted(window.gpus)):
            g = window.gpus[gpu]
            series.append(Series(f"{gpu} power_w", gpu, PALETTE[(j + 1) % len(PALETTE)], tuple(g["t"]), tuple(g["power_w"])))
        ts, totals = total_power(window)
        series.insert(0, Series("total power_w", "total", PALETTE[0], ts, totals))
        y0, y1 = _range(list(totals))
        panels.append(Panel("all GPUs power", "W", tuple(series), y0, y1))
    for gpu in sorted(window.gpus):
        g = window.gpus[gpu]
        for title, unit, cols in GPU_PANELS:
            series = []
            allv: list[float] = []
            for j, (col, label, k, dashed) in enumerate(cols):
                vs = _scaled(g[col], k)
                if all(v is None for v in vs):
                    continue
                allv += [v for v in vs if v is not None]
                series.append(Series(f"{gpu} {col}", label, PALETTE[j], tuple(g["t"]), vs, dashed))
            lim = tuple(v for k_, v in (gpu_limits or {}).get(gpu, {}).items() if any(k_ == c for c, *_ in cols))
            y0, y1 = _range(allv, extra=lim)
            panels.append(Panel(f"{gpu} {title}", unit, tuple(series), y0, y1))
    if window.engines:
        for col, title, unit in (("tokens_per_s", "engines tokens/s", "tok/s"),
                                 ("no_progress_s", "engines no progress", "s")):
            series = []
            allv = []
            for j, name in enumerate(sorted(window.engines)):
                e = window.engines[name]
                vs = tuple(e[col])
                allv += [v for v in vs if v is not None]
                series.append(Series(f"{name} {col}", name, PALETTE[j % len(PALETTE)], tuple(e["t"]), vs))
            y0, y1 = _range(allv)
            panels.append(Panel(title, unit, tuple(series), y0, y1))
    markers = tuple(Marker(e["time"], e["severity"], e["kind"], e.get("id"))
                    for e in window.events if e["severity"] in ("warning", "alert", "critical"))
    return Figure(window.start, window.end, focus, tuple(panels), markers)

