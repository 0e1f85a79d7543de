"""The flight recorder, read back: GPU series, engine series and events in a time window.

Two doors to the same rows: the running daemon's recorder (its own connection, so reads
queue behind writes and never see half a cycle) and a `flight.sqlite` file opened
read-only — a copy taken from a host that tripped its PSU works the same on a laptop
(INCIDENTS §2: the samples before the trip are what the owner needs to see).

Only the file's shape ties it to the recorder (sinks/recorder.py writes the rows): reading
and drawing a recording needs no sink, so the reader lives with the reports.
"""
from __future__ import annotations

import json
import fcntl
import os
import struct
import re
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Callable

# Column order of `samples` after t, gpu (sinks/recorder.py SCHEMA); the names are the
# series names every reader (page, report, `gpuguard record`) uses.
GPU_SERIES = ("up", "power_w", "cap_w", "edge_c", "junction_c", "mem_c", "sclk_hz", "mclk_hz", "fan_rpm", "busy",
              "vram_used")
ENGINE_SERIES = ("tokens_total", "tokens_per_s", "no_progress_s", "running", "waiting")

Query = Callable[[str, tuple], list[tuple]]


class HistoryError(RuntimeError):
    """The recorder file cannot be read (missing, not a gpuguard recorder, corrupt)."""


def parse_duration(text: str) -> float:
    """`90`, `90s`, `2m`, `1h`, `1d` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (examples: 90s, 2m, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


# A moment is a finite unix time a clock can print: `at=nan`, `inf` or 1e308 reached
# time.localtime and failed there; year 9999 is the last one it formats everywhere.
UNIX_TIME_MAX = 253402300799.0


def parse_time(text: str) -> float:
    """A unix time (`1764583274.5`), an ISO time (`2026-12-01T03:01:14`, local unless it
    says Z/+hh:mm) or a time ago (`10m` = ten minutes before now)."""
    try:
        t = float(text)
    except ValueError:
        pass
    else:
        if not 0 <= t <= UNIX_TIME_MAX:  # False for nan too
            raise ValueError(f"{text!r} is not a time (a unix time between 0 and {UNIX_TIME_MAX:.0f}, "
                             "2026-12-01T03:01:14, or an age like 10m)")
        return t
    try:
        return time.time() - parse_duration(text)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(f"{text!r} is not a time (unix seconds, 2026-12-01T03:01:14, or an age like 10m)") from None


@dataclass(frozen=True)
class Window:
    """What one report or page view shows: every GPU's and engine's samples and the
    events between `start` and `end`, oldest first."""

    start: float
    end: float
    gpus: dict[str, dict[str, list]]  # gpu -> {"t": [...], "bdf": str, series: [...]}
    engines: dict[str, dict[str, list]]  # engine -> {"t": [...], "state": [...], series: [...]}
    events: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "gpus": self.gpus, "engines": self.engines, "events": self.events}


class FlightLog:
    """Reads a recorder through `query(sql, args)`: `FlightRecorder.query` in the daemon,
    or `FlightLog.open(path)` for a file."""

    def __init__(self, query: Query, path: str = "recorder", live: bool | None = None) -> None:
        self._query = query
        self.path = path
        self._live = live  # None: ask the file (writer_alive)

    @classmethod
    def open(cls, path: str) -> "FlightLog":
        if not os.path.exists(path):
            raise HistoryError(f"flight recorder {path} not found (recorder.path in gpuguard.yaml; "
                               "default /var/lib/gpuguard/flight.sqlite)")
        # mode=ro: never write a file the owner copied as evidence. A WAL file next to it
        # needs a writable folder for the -shm; where that fails (a read-only stick),
        # immutable=1 reads the main file alone (what was checkpointed into it).
        tables: set[str] = set()
        db = None
        for mode in ("mode=ro", "immutable=1"):
            try:
                db = sqlite3.connect(f"file:{os.path.abspath(path)}?{mode}", uri=True, check_same_thread=False)
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                break
            except sqlite3.Error as e:
                error = e
                if db is not None:
                    db.close()
                    db = None
        if db is None:
            raise HistoryError(f"flight recorder {path}: cannot read it as SQLite: {error}")
        if not {"samples", "events"} <= tables:
            raise HistoryError(f"{path} is an SQLite file but not a gpuguard flight recorder "
                               f"(no samples/events tables; has: {', '.join(sorted(tables)) or 'none'})")
        log = cls(lambda sql, args: db.execute(sql, args).fetchall(), path)
        log._has_engines = "engine_samples" in tables
        log._db = db
        return log

    _has_engines = True
    _db: sqlite3.Connection | None = None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    def writer_alive(self) -> bool:
        """True while a process other than this one has the recording open (the daemon
        writing it): every SQLite connection to a WAL database holds a shared lock on the
        -shm file's DMS byte (offset 128) while it is open; a killed writer holds none. A
        copied file, or one whose daemon is gone, has no such holder."""
        if self._live is not None:
            return self._live
        try:
            fd = os.open(self.path + "-shm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # no -shm: nobody has it open in WAL mode
        try:
            probe = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 128, 1, 0)
            held = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, probe))[0]
            return held != fcntl.F_UNLCK
        except OSError:
            return False
        finally:
            os.close(fd)

    def stopped_cleanly(self) -> bool:
        """The recording ends with the marker of a clean stop (sinks/recorder.py
        `mark_stopped`), after its last sample."""
        (last,), = self.q("SELECT max(t) FROM samples")
        (marker,), = self.q("SELECT max(t) FROM events WHERE kind = 'recording_stopped'")
        return marker is not None and (last is None or marker >= last)

    def q(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._query(sql, args)
        except sqlite3.Error as e:
            raise HistoryError(f"flight recorder {self.path}: {e}") from None

    # -- what is in it -----------------------------------------------------------------
    def bounds(self) -> tuple[float, float] | None:
        lo, hi = self.q("SELECT min(t), max(t) FROM samples")[0]
        elo, ehi = self.q("SELECT min(t), max(t) FROM events")[0]
        los = [x for x in (lo, elo) if x is not None]
        his = [x for x in (hi, ehi) if x is not None]
        return (min(los), max(his)) if los else None

    def samples(self, start: float, end: float, gpu: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT t, gpu, bdf, " + ", ".join(GPU_SERIES) + ", errors FROM samples WHERE t >= ? AND t <= ?"
        args: tuple = (start, end)
        if gpu:
            sql += " AND (gpu = ? OR bdf = ?)"
            args += (gpu, gpu)
        rows = self.q(sql + " ORDER BY t, gpu", args)
        keys = ("t", "gpu", "bdf") + GPU_SERIES + ("errors",)
        return [dict(zip(keys, r)) for r in rows]

    def engine_samples(self, start: float, end: float) -> list[dict[str, Any]]:
        if not self._has_engines:
            return []
        rows = self.q("SELECT t, engine, state, " + ", ".join(ENGINE_SERIES)
                      + " FROM engine_samples WHERE t >= ? AND t <= ? ORDER BY t, engine", (start, end))
        return [dict(zip(("t", "engine", "state") + ENGINE_SERIES, r)) for r in rows]

    def events(self, start: float, end: float, gpu: str | None = None, min_severity: str | None = None,
               limit: int | None = None) -> list[dict[str, Any]]:
        sql = "SELECT rowid, t, kind, severity, source, gpu, bdf, engine, message, fields FROM events WHERE t >= ? AND t <= ?"
        args: tuple = (start, end)
        if gpu:
            sql += " AND (gpu = ? OR bdf = ?)"
            args += (gpu, gpu)
        if min_severity == "alert":
            sql += " AND severity IN ('alert', 'critical')"
        if limit:  # the newest `limit`, still handed out oldest first
            rows = self.q(sql + " ORDER BY t DESC, rowid DESC LIMIT ?", args + (int(limit),))[::-1]
        else:
            rows = self.q(sql + " ORDER BY t, rowid", args)
        return [_event(r) for r in rows]

    def event(self, event_id: int) -> dict[str, Any]:
        rows = self.q("SELECT rowid, t, kind, severity, source, gpu, bdf, engine, message, fields FROM events WHERE rowid = ?",
                      (int(event_id),))
        if not rows:
            raise HistoryError(f"flight recorder {self.path} has no event {event_id} "
                               "(`gpuguard record --json` lists events with their id)")
        return _event(rows[0])

    def event_near(self, t: float, slack: float = 1.0) -> dict[str, Any] | None:
        """The most severe event within `slack` seconds of `t` (the one a report is about)."""
        near = self.events(t - slack, t + slack)
        if not near:
            return None
        rank = {"critical": 3, "alert": 2, "warning": 1, "info": 0}
        return max(near, key=lambda e: (rank.get(e["severity"], 0), -abs(e["time"] - t)))

    def window(self, start: float, end: float, gpu: str | None = None) -> Window:
        gpus: dict[str, dict[str, list]] = {}
        for s in self.samples(start, end, gpu):
            g = gpus.setdefault(s["gpu"], {"bdf": s["bdf"], "t": [], **{k: [] for k in GPU_SERIES}})
            g["t"].append(s["t"])
            for k in GPU_SERIES:
                g[k].append(s[k])
        engines: dict[str, dict[str, list]] = {}
        for s in self.engine_samples(start, end):
            e = engines.setdefault(s["engine"], {"t": [], "state": [], **{k: [] for k in ENGINE_SERIES}})
            e["t"].append(s["t"])
            e["state"].append(s["state"])
            for k in ENGINE_SERIES:
                e[k].append(s[k])
        return Window(start, end, gpus, engines, self.events(start, end))


def _event(r: tuple) -> dict[str, Any]:
    rowid, t, kind, severity, source, gpu, bdf, engine, message, fields = r
    try:
        f = json.loads(fields) if fields else {}
    except ValueError:
        f = {"raw": fields}
    return {"id": rowid, "time": t, "kind": kind, "severity": severity, "source": source, "gpu": gpu, "bdf": bdf,
            "engine": engine, "message": message, "fields": f}
