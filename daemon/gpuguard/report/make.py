"""One report: pick the moment (an event by id, a time, or by default the newest
incident — else the last sample, which after a PSU trip is the moment the recording
stopped), read the window around it and draw it as HTML and PNG.

The default: a recording cut short after its newest alert (no clean stop, no writer
left: a SIGKILL, a crash, a PSU trip) is about the stop, INCIDENTS §2's moment; else the
newest incident's most severe alert, its first: the alert-grade events of the `before`
seconds up to the newest one are one incident, and a lost GPU is its event, not the
`gpus_missing` that follows it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuguard.report.figure import Figure, build_figure
from gpuguard.report.html import headline, render_html
from gpuguard.report.png import render_png
from gpuguard.report.history import FlightLog, HistoryError, Window


@dataclass(frozen=True)
class Report:
    focus: float
    event: dict[str, Any] | None
    window: Window
    figure: Figure
    html: str
    png: bytes


RANK = {"alert": 0, "critical": 1}


def pick_focus(flight: FlightLog, event_id: int | None, at: float | None,
               before: float = 120.0) -> tuple[float, dict[str, Any] | None]:
    if event_id is not None:
        e = flight.event(event_id)
        return e["time"], e
    if at is not None:
        return at, flight.event_near(at)
    bounds = flight.bounds()
    if bounds is None:
        raise HistoryError(f"flight recorder {flight.path} is empty: nothing to report")
    newest = flight.events(bounds[0], bounds[1], min_severity="alert", limit=1)
    last = flight.q("SELECT max(t) FROM samples")[0][0]
    if not newest:
        return (last if last is not None else bounds[1]), None
    te = newest[-1]["time"]
    if last is not None and last > te and not flight.stopped_cleanly() and not flight.writer_alive():
        return last, None  # cut short after the alert: the stop is the news
    incident = flight.events(te - before, te, min_severity="alert")
    # most severe first, then the earliest of those: the cause comes before its echoes
    e = max(incident, key=lambda e: (RANK.get(e["severity"], 0), -e["time"]))
    return e["time"], e


def make_report(flight: FlightLog, *, event_id: int | None = None, at: float | None = None, before: float = 120.0,
                after: float = 60.0, gpu: str | None = None, png_name: str | None = None) -> Report:
    focus, event = pick_focus(flight, event_id, at, before)
    window = flight.window(focus - before, focus + after, gpu)
    fig = build_figure(window, focus)
    title, _ = headline(window, focus, event)
    html = render_html(window, fig, focus, event, flight.path, png_name)
    png = render_png(fig, f"gpuguard report: {title}")
    return Report(focus, event, window, fig, html, png)
