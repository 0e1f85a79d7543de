"""The built-in web page, served by the daemon on its API port: `/` and its assets (plain
HTML/JS/CSS shipped in the package under sinks/page/, no framework, no CDN: it works on an
air-gapped host), the history it charts (`GET /v1/history`, from the flight recorder) and
incident reports rendered on demand (`GET /report?event=ID|at=T`, the same report as
`gpuguard report`), and engine incident bundles rendered the same way
(`GET /incident?name=NAME`, the report of `gpuguard report --incident NAME`; NAME as
`GET /v1/incidents` lists it, never a path).

Same access rules as the read API (sinks/read_api.py `read_route`); the page's actions go
through the existing POST endpoints with the bearer token the user types in — nothing here
changes state, and nothing is ever done from a GET.

  GET /v1/history?since=T&until=T&points=N&gpu=NAME
      {"start", "end", "step", "gpus": {gpu: {"bdf", "t": [...], series: [...]}},
       "engines": {engine: {"t", "state", series...}}, "events": [event + "id"]}
      series as in report/history.py; averaged into buckets of `step` seconds so that an
      hour of 8 GPUs stays a small document (at most `points` per series, default 300).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import operator
import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import quote

from pydantic import Field
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from gpuguard.report.history import ENGINE_SERIES, GPU_SERIES, UNIX_TIME_MAX, FlightLog, HistoryError
from gpuguard.sinks.read_api import Query, query, read_route
from gpuguard.sinks.recorder import FlightRecorder

if TYPE_CHECKING:
    from gpuguard.sinks.api import Api

ASSETS = {"page.js": "text/javascript", "page.css": "text/css", "favicon.svg": "image/svg+xml"}
# The page may talk to its own origin only: a stray URL in a label can never phone home.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# A report is one self-contained file: its CSS is inline, and it has no script at all.
REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'"


def _asset(name: str) -> bytes:
    return resources.files("gpuguard.sinks").joinpath("page", name).read_bytes()


def _version(name: str) -> str:
    return hashlib.sha256(_asset(name)).hexdigest()[:16]


def _index_html() -> bytes:
    """index.html with its script and stylesheet named by content (`page.js?v=HASH`): the
    browser keeps them and a reload fetches neither (on a loaded host each request is a
    wait for a core), while a new gpuguard's page is a new URL, never a stale copy."""
    html = _asset("index.html")
    for name in ("page.js", "page.css"):
        html = html.replace(f'"/page/{name}"'.encode(), f'"/page/{name}?v={_version(name)}"'.encode())
    return html


# Bucket widths: fixed steps aligned to multiples of themselves, so a bucket that has
# finished is the same bucket in every later request and its average can be kept.
STEPS = (0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
SETTLE_SECONDS = 10.0  # a poll's rows are committed well within this
# An entry no request asked for within this goes: the page asks every 2 s. A window that
# grows (a view from the start, a daemon younger than the window) moves to coarser steps,
# and each finer step's entry stayed until 32 were kept: 7 entries and 7.7 times the rows
# the view needed after two hours, the daemon's memory creeping while a page was open.
IDLE_SECONDS = 60.0


class BucketCache:
    """Averages of finished buckets never change: keep them, and aggregate only the buckets
    since (the page polls every 2 s; an hour of 8 GPUs is 57 600 rows to average once)."""

    def __init__(self, max_entries: int = 32, idle_seconds: float = IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._entries: dict[tuple, tuple[int, int, dict]] = {}  # key -> (lo, settled, {(who, k): row})
        self._asked: dict[tuple, float] = {}  # key -> when a request last asked for it (clock)

    def __len__(self) -> int:
        return len(self._entries)

    def kept_rows(self) -> int:
        return sum(len(rows) for _, _, rows in self._entries.values())

    def _forget_idle(self, now: float) -> None:
        for key in [k for k, t in self._asked.items() if now - t > self.idle_seconds]:
            self._entries.pop(key, None)
            del self._asked[key]

    def rows(self, flight: FlightLog, sql: str, key: tuple, step: float, start: float, end: float,
             args: tuple = ()) -> list[tuple]:
        """`sql` selects (who, bucket, ...) for `t >= ? AND t <= ?` + `args`, grouped by
        who and bucket = CAST(t / step AS INTEGER)."""
        lo_k, hi_k = int(start // step), int(end // step)
        now = self.clock()
        self._forget_idle(now)
        self._asked[key] = now
        lo, settled, rows = self._entries.get(key, (lo_k, lo_k - 1, {}))
        if lo_k < lo:  # asked further back than what is kept: start over
            lo, settled, rows = lo_k, lo_k - 1, {}
        for r in flight.q(sql, (max(start, (settled + 1) * step), end) + args):
            rows[(r[0], r[1])] = r
        # finished: older than the settle time, and older than the newest bucket with rows
        # (rows only ever arrive at the end; the newest bucket may still be filling)
        newest = max((k for _, k in rows), default=lo_k - 1)
        now_settled = min(hi_k, newest - 1, int((time.time() - max(2 * step, SETTLE_SECONDS)) // step))
        new_lo, new_settled = max(lo, lo_k), max(settled, now_settled)
        if new_settled > settled or new_lo > lo:
            self._entries.pop(key, None)
            if len(self._entries) >= self.max_entries:
                oldest = next(iter(self._entries))
                self._entries.pop(oldest)
                self._asked.pop(oldest, None)
            # what scrolled out of this request's window goes (a page left open for a day
            # must not grow the cache); a later request further back starts over
            self._entries[key] = (new_lo, new_settled,
                                  {k: v for k, v in rows.items() if new_lo <= k[1] <= new_settled})
        return [rows[k] for k in sorted(rows) if lo_k <= k[1] <= hi_k]


def _columns(rows: list[tuple]) -> list[tuple[str, list[list]]]:
    """Rows sorted by (who, bucket) -> [(who, [column, ...])], each column a list."""
    out: list[tuple[str, list[list]]] = []
    for who, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        out.append((who, [list(c) for c in zip(*group)]))
    return out


def bucketed(flight: FlightLog, start: float, end: float, points: int, gpu: str | None,
             cache: BucketCache | None = None) -> dict:
    """Series averaged per `step`-second bucket (SQLite does the work; the page gets at
    most about `points` per series)."""
    cache = cache if cache is not None else BucketCache()
    # Bucket over the span that has data: a daemon started two minutes ago asked for an
    # hour gets its two minutes at full resolution, not ten points.
    asked = start
    first = flight.q("SELECT min(t) FROM samples WHERE t >= ? AND t <= ?", (start, end))[0][0]
    if first is not None:
        start = max(start, first)
    step = next((s for s in STEPS if s >= (end - start) / max(points, 1)), STEPS[-1])
    # `up` as a minimum: one lost sample in a bucket shows as down, not as 0.97. SQLite
    # rounds (in C): the page polls every 2 s, and rounding 23 000 values in Python was
    # most of the cost of an hour of 8 GPUs.
    agg = ", ".join("min(up)" if k == "up" else f"round(avg({k}), 3)" for k in GPU_SERIES)
    where, args = "", ()
    if gpu:
        where, args = " AND (gpu = ? OR bdf = ?)", (gpu, gpu)
    bucket = f"CAST(t / {step!r} AS INTEGER)"
    rows = cache.rows(flight, f"SELECT gpu, {bucket} AS k, max(bdf), round(max(t), 3), {agg} FROM samples "
                              f"WHERE t >= ? AND t <= ?{where} GROUP BY gpu, k", ("samples", gpu, step), step, start, end, args)
    gpus: dict[str, dict] = {}
    for name, cols in _columns(rows):
        gpus[name] = {"bdf": cols[2][0], "t": cols[3], **dict(zip(GPU_SERIES, cols[4:]))}
    engines: dict[str, dict] = {}
    try:
        eagg = ", ".join(f"round(avg({k}), 3)" for k in ENGINE_SERIES)
        erows = cache.rows(flight, f"SELECT engine, {bucket} AS k, round(max(t), 3), max(state), {eagg} FROM engine_samples "
                                   "WHERE t >= ? AND t <= ? GROUP BY engine, k", ("engines", step), step, start, end)
    except HistoryError:
        erows = []  # a recorder file from before engine rows existed
    for name, cols in _columns(erows):
        engines[name] = {"t": cols[2], "state": cols[3], **dict(zip(ENGINE_SERIES, cols[4:]))}
    events = flight.events(asked, end, gpu, limit=500)
    return {"start": start, "end": end, "step": step, "gpus": gpus, "engines": engines, "events": events}


# `at=nan`, `inf` or 1e308 answered 500: a moment is a finite unix time (UNIX_TIME_MAX).
def _moment(description: str) -> Any:
    return Field(None, ge=0, le=UNIX_TIME_MAX, allow_inf_nan=False, description=description)


class HistoryQuery(Query):
    since: float | None = _moment("unix time (default: 15 minutes ago)")
    until: float | None = _moment("unix time (default: now)")
    points: int = Field(300, ge=10, le=5000, description="at most this many points per series")
    gpu: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")


class ReportQuery(Query):
    event: int | None = Field(None, ge=1)
    at: float | None = _moment("unix time of the moment to report on")
    before: float = Field(120, ge=1, le=86400)
    after: float = Field(60, ge=0, le=86400)


class IncidentQuery(Query):
    name: str = Field(max_length=200)


def mount_page(app: Api, recorder: Callable[[], FlightRecorder | None]) -> None:
    """Add the page's routes to the daemon's app (sinks/api.Api). `recorder()` is the
    running flight recorder, or None when `recorder.enabled` is off (history answers 501
    then)."""
    cache = BucketCache()

    def flight() -> FlightLog:
        rec = recorder()
        if rec is None:
            raise HTTPException(501, detail="the flight recorder is off (recorder.enabled: false): no history")
        return FlightLog(rec.query, rec.path, live=True)  # this daemon writes it

    def index(request: Request) -> Response:
        return Response(_index_html(), media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})

    def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            raise HTTPException(404, detail=f"no page asset named {name!r}")
        body = _asset(name)
        # the URL index.html names carries the content's hash: that copy never changes
        v = request.query_params.get("v")
        fixed = v is not None and v == hashlib.sha256(body).hexdigest()[:16]
        return Response(body, media_type=ASSETS[name],
                        headers={"Cache-Control": "max-age=31536000, immutable" if fixed else "no-cache"})

    def history(request: Request) -> Response:
        q = query(request, HistoryQuery)
        end = q.until if q.until is not None else time.time()
        start = q.since if q.since is not None else end - 900
        if start > end:
            raise HTTPException(422, detail=f"since ({start}) is after until ({end})")
        try:
            doc = bucketed(flight(), start, end, q.points, q.gpu, cache)
        except HistoryError as e:
            raise HTTPException(500, detail=str(e)) from None
        # plain json.dumps: no encoder walking every one of the ~30 000 numbers
        return Response(json.dumps(doc, separators=(",", ":")), media_type="application/json")

    def _report(q: ReportQuery, png_name: str | None = None):
        from gpuguard.report.make import make_report

        if q.event is None and q.at is None:
            raise HTTPException(422, detail="say which moment: ?event=ID or ?at=UNIXTIME")
        try:
            return make_report(flight(), event_id=q.event, at=q.at, before=q.before, after=q.after, png_name=png_name)
        except HistoryError as e:
            raise HTTPException(404, detail=str(e)) from None

    def report(request: Request) -> HTMLResponse:
        q = query(request, ReportQuery)
        args = "&".join(f"{k}={v}" for k, v in (("event", q.event), ("at", q.at), ("before", q.before),
                                                  ("after", q.after)) if v is not None)
        rep = _report(q, png_name=f"/report.png?{args}")
        return HTMLResponse(rep.html, headers={"Content-Security-Policy": REPORT_CSP})

    def report_png(request: Request) -> Response:
        return Response(_report(query(request, ReportQuery)).png, media_type="image/png")

    def _incident(request: Request, png: bool = False):
        from gpuguard.report.incident import BundleError, make_incident_report

        name = query(request, IncidentQuery).name
        provider = getattr(request.app.state.actions, "incidents", None)
        listed = {b["name"]: b["path"] for b in (provider() if provider is not None else [])}
        if name not in listed:  # only a listed bundle: the name is never joined into a path
            raise HTTPException(404, detail=f"no incident bundle named {name!r} (GET /v1/incidents lists them)")
        try:
            return make_incident_report(listed[name], png_name=None if png else f"/incident.png?name={quote(name)}")
        except BundleError as e:
            raise HTTPException(404, detail=str(e)) from None

    def incident(request: Request) -> HTMLResponse:
        return HTMLResponse(_incident(request).html, headers={"Content-Security-Policy": REPORT_CSP})

    def incident_png(request: Request) -> Response:
        return Response(_incident(request, png=True).png, media_type="image/png")

    app.add_reads([
        read_route("/", index, blocking=True),
        read_route("/page/{name}", asset, blocking=True),
        read_route("/v1/history", history, blocking=True),
        read_route("/report", report, blocking=True),
        read_route("/report.png", report_png, blocking=True),
        read_route("/incident", incident, blocking=True),
        read_route("/incident.png", incident_png, blocking=True),
    ])
