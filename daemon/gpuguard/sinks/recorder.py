"""Flight recorder: telemetry and events on persistent storage (SQLite), so the seconds
before a power trip or a hang survive the hard reboot that follows (INCIDENTS §2: power
samples written to /tmp were lost in the reboot the trip caused).

Each poll cycle is one transaction, committed with `synchronous=FULL` (the WAL is
fsynced at every commit: what was recorded is on disk). Writes run on a single
background thread so a slow disk never delays the poller. Old rows are pruned to
`keep_seconds`.

Events wait in memory (`add_event`) and go in the next cycle's transaction
with the samples — a kernel flood of one transaction per event queued ahead of the
samples and a SIGKILL lost seconds of them. The database is bounded by size too
(`max_bytes`, pages in use): past it the oldest rows are pruned. Losses are counted and
exported: `gpuguard_recorder_write_failures_total`, `gpuguard_recorder_events_dropped_total`
(the in-memory backlog overflowed), `gpuguard_recorder_rows_total{table}`,
`gpuguard_recorder_bytes` (file size on disk, WAL included).

The file is checked before every transaction (one stat: device and inode): deleted or
replaced under the running daemon, writes went on into the unlinked inode and every row
after it was lost without a word. Now the recording is reopened as a new file at the
path, counted (`gpuguard_recorder_file_lost_total`) and said in a `recorder_file_lost`
event (handed to `publish` on the caller's thread at the next `record()`).

A clean stop ends the recording with a `recording_stopped` event (`mark_stopped`): a
recording that ends without one was cut short (SIGKILL, a crash, a PSU trip), and the
default report is about that moment (report/make.py).

A report that must see an event reads after the transaction that holds it: `record()`
returns that transaction's future; `flush()` waits for everything handed in so far.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import logging
import os
import sqlite3
import time
from typing import Any, Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot

log = logging.getLogger("gpuguard.recorder")

SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
  t REAL NOT NULL, gpu TEXT NOT NULL, bdf TEXT NOT NULL, up INTEGER NOT NULL,
  power_w REAL, cap_w REAL, edge_c REAL, junction_c REAL, mem_c REAL,
  sclk_hz REAL, mclk_hz REAL, fan_rpm REAL, busy REAL, vram_used REAL, errors TEXT
);
CREATE INDEX IF NOT EXISTS samples_t ON samples(t);
CREATE TABLE IF NOT EXISTS events (
  t REAL NOT NULL, kind TEXT NOT NULL, severity TEXT NOT NULL, source TEXT NOT NULL,
  gpu TEXT, bdf TEXT, engine TEXT, message TEXT NOT NULL, fields TEXT
);
CREATE INDEX IF NOT EXISTS events_t ON events(t);
CREATE TABLE IF NOT EXISTS power_windows (
  t REAL NOT NULL, gpu TEXT NOT NULL, bdf TEXT NOT NULL, source TEXT NOT NULL, samples INTEGER NOT NULL,
  peak_w REAL, p99_w REAL, mean_w REAL, errors INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS power_windows_t ON power_windows(t);
CREATE TABLE IF NOT EXISTS power_host (
  t REAL NOT NULL, gpu_peak_sum_w REAL, gpu_mean_sum_w REAL, other_w REAL, psu_w REAL, limit_w REAL,
  alerting INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS power_host_t ON power_host(t);
CREATE TABLE IF NOT EXISTS power_burst (t REAL NOT NULL, gpu TEXT NOT NULL, w REAL NOT NULL, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS power_burst_t ON power_burst(t);
CREATE TABLE IF NOT EXISTS engine_samples (
  t REAL NOT NULL, engine TEXT NOT NULL, state TEXT, tokens_total REAL, tokens_per_s REAL,
  no_progress_s REAL, running REAL, waiting REAL
);
CREATE INDEX IF NOT EXISTS engine_samples_t ON engine_samples(t);
"""
# the fast power sampler's per-interval statistics, the host PSU verdict, and the
# raw samples around a power alert (INCIDENTS §2: the seconds before a trip must survive it).
POWER_TABLES = {"power_windows": 9, "power_host": 7, "power_burst": 4}
EVENT_BACKLOG = 50_000  # events waiting for the next cycle; past it they are counted lost
PRUNE_EVERY = 60.0
CACHE_KIB = 256  # SQLite page cache of the writing connection (see _open)


class FlightRecorder:
    def __init__(self, path: str, keep_seconds: float = 86400.0, max_bytes: int | None = None,
                 publish: Callable[[Event], object] | None = None) -> None:
        self.path = path
        self.publish = publish  # where the recorder's own events go (the hub), on the caller's thread
        self.files_lost = 0
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file written
        self._notices: collections.deque[Event] = collections.deque()
        self.keep_seconds = keep_seconds
        self.max_bytes = max_bytes
        self.failures = 0
        self.events_dropped = 0
        self.rows: collections.Counter[str] = collections.Counter()  # table -> rows committed
        self.pruned_for_size = 0
        self._backlog: collections.deque[Event] = collections.deque()
        self._backlog_lock = threading.Lock()
        # power rows handed in for the cycle's own transaction (record_power(cycle=True))
        self._power_rows: dict[str, list[tuple]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuguard-recorder")
        self._db: sqlite3.Connection | None = None
        self._last_prune = 0.0
        self._pool.submit(self._open).result()

    def _open(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False)
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # takes effect on a new file: pruning can shrink it
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        # The recorder only appends (and prunes the oldest now and then); reads go through
        # report/history's own connections. SQLite's default page cache of 2 MiB filled up
        # within a minute at 32 GPUs and stayed: a quarter of the daemon's growth over the
        # 4-GPU host (issue 15). 256 KiB holds the pages an append touches.
        db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        db.executescript(SCHEMA)
        db.commit()
        self._db = db
        st = os.stat(self.path)
        self._identity = (st.st_dev, st.st_ino)

    def _check_file(self) -> None:
        """Reopen the recording when its file was deleted or replaced (see the module doc)."""
        try:
            st = os.stat(self.path)
            now: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        except OSError:
            return  # cannot tell (EIO, EACCES): the write says what is wrong
        if self._db is not None and now == self._identity:
            return
        if self._db is not None:
            what = "deleted" if now is None else "replaced by another file"
            self.files_lost += 1
            log.error("recorder file %s was %s while recording: rows since went into the old file; "
                      "recording goes on in a new file there (see gpuguard_recorder_file_lost_total)",
                      self.path, what)
            self._notices.append(Event(
                kind="recorder_file_lost", severity="alert", source="recorder",
                message=f"flight recording {self.path} was {what} while gpuguard was writing it: the rows "
                        "since then are lost; recording goes on in a new file at that path",
                fields={"path": self.path, "what": what, "times": self.files_lost}))
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None
        try:
            self._open()
        except (OSError, sqlite3.Error) as e:
            self._db = None  # tried again before the next transaction; each one counted failed
            raise sqlite3.OperationalError(f"cannot reopen {self.path}: {e}") from e

    def _write(self, samples: list[tuple], events: list[tuple], engines: list[tuple] = (),
               power: dict[str, list[tuple]] | None = None) -> None:
        try:
            self._check_file()
            assert self._db is not None
            with self._db:
                for table, rows in (power or {}).items():
                    if rows:
                        marks = ",".join("?" * POWER_TABLES[table])
                        self._db.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
                if samples:
                    self._db.executemany("INSERT INTO samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", samples)
                if events:
                    self._db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?)", events)
                if engines:
                    self._db.executemany("INSERT INTO engine_samples VALUES (?,?,?,?,?,?,?,?)", engines)
                now = time.time()
                if now - self._last_prune > PRUNE_EVERY:
                    cutoff = now - self.keep_seconds
                    self._db.execute("DELETE FROM samples WHERE t < ?", (cutoff,))
                    self._db.execute("DELETE FROM events WHERE t < ?", (cutoff,))
                    for table in POWER_TABLES:
                        self._db.execute(f"DELETE FROM {table} WHERE t < ?", (cutoff,))
                    self._db.execute("DELETE FROM engine_samples WHERE t < ?", (cutoff,))
                    self._last_prune = now
                    self._prune_for_size()
            self.rows["samples"] += len(samples)
            self.rows["events"] += len(events)
        except sqlite3.Error as e:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:  # counted always; logged, not 2,439 times
                log.error("recorder write failed path=%s error=%s (failures so far: %d, see "
                          "gpuguard_recorder_write_failures_total)", self.path, e, self.failures)

    def used_bytes(self) -> int:
        assert self._db is not None
        (page,), = self._db.execute("PRAGMA page_size").fetchall()
        (count,), = self._db.execute("PRAGMA page_count").fetchall()
        (free,), = self._db.execute("PRAGMA freelist_count").fetchall()
        return (count - free) * page

    def _prune_for_size(self) -> None:
        """Past `max_bytes` in use: delete the oldest tenth of the time span until under."""
        if not self.max_bytes:
            return
        assert self._db is not None
        for _ in range(20):
            if self.used_bytes() <= self.max_bytes:
                break
            (lo, hi), = self._db.execute("SELECT min(t), max(t) FROM samples").fetchall()
            (elo, ehi), = self._db.execute("SELECT min(t), max(t) FROM events").fetchall()
            lo = min(x for x in (lo, elo) if x is not None) if (lo, elo) != (None, None) else None
            hi = max(x for x in (hi, ehi) if x is not None) if (hi, ehi) != (None, None) else None
            if lo is None or hi is None or hi <= lo:
                break
            cut = lo + (hi - lo) / 10
            self._db.execute("DELETE FROM samples WHERE t <= ?", (cut,))
            self._db.execute("DELETE FROM events WHERE t <= ?", (cut,))
            for table in (*POWER_TABLES, "engine_samples"):
                self._db.execute(f"DELETE FROM {table} WHERE t <= ?", (cut,))
            self.pruned_for_size += 1
        self._db.execute("PRAGMA incremental_vacuum")

    @staticmethod
    def sample_rows(snap: HostSnapshot) -> list[tuple]:
        rows = []
        for g in snap.gpus:
            t = g.temperatures
            rows.append(
                (
                    g.time, g.name, g.bdf, int(g.up), g.power_watts, g.power_cap_watts,
                    t.get("edge", t.get("gpu")), t.get("junction"), t.get("mem"),
                    g.clocks_hz.get("sclk"), g.clocks_hz.get("mclk"), g.fan_rpm, g.busy_ratio,
                    g.vram_used_bytes, json.dumps(dict(g.errors)) if g.errors else None,
                )
            )
        return rows

    @staticmethod
    def event_rows(events: Iterable[Event]) -> list[tuple]:
        return [
            (e.time, e.kind, e.severity, e.source, e.gpu, e.bdf, e.engine, e.message, json.dumps(dict(e.fields), default=str))
            for e in events
        ]

    @staticmethod
    def engine_rows(engines: Mapping[str, Any] | None, t: float) -> list[tuple]:
        """One row per engine snapshot (engines/snapshot.py): the engine progress an
        incident report plots next to the GPUs (INCIDENTS §1: tokens stopped, then the bus)."""
        rows = []
        for name, e in sorted((engines or {}).items()):
            rows.append((t, name, e.state, e.generated_tokens_total, e.tokens_per_second, e.no_progress_seconds,
                         e.requests_running, e.requests_waiting))
        return rows

    def add_event(self, event: Event) -> None:
        """Keep `event` for the next cycle's transaction (any thread; never blocks)."""
        with self._backlog_lock:
            if len(self._backlog) >= EVENT_BACKLOG:
                self.events_dropped += 1
                return
            self._backlog.append(event)

    def revise_event(self, old: Event, new: Event) -> None:
        """`new` replaces `old` (state/hub.py `revise`): in the backlog while it waits there,
        else its row is updated in the next transaction's place (any thread; never blocks)."""
        with self._backlog_lock:
            for i in range(len(self._backlog) - 1, -1, -1):
                if self._backlog[i] is old:
                    self._backlog[i] = new
                    return
        (row,) = self.event_rows([new])
        self._pool.submit(self._update_event, (old.time, old.kind, old.message), row)

    def _update_event(self, where: tuple, row: tuple) -> None:
        try:
            self._check_file()
            assert self._db is not None
            with self._db:
                self._db.execute("UPDATE events SET t=?, kind=?, severity=?, source=?, gpu=?, bdf=?, engine=?, "
                                 "message=?, fields=? WHERE rowid = (SELECT max(rowid) FROM events "
                                 "WHERE t = ? AND kind = ? AND message = ?)", (*row, *where))
        except sqlite3.Error as e:
            self.failures += 1
            log.error("recorder update failed path=%s error=%s (failures so far: %d)", self.path, e, self.failures)

    def _take_backlog(self) -> list[Event]:
        with self._backlog_lock:
            out = list(self._backlog)
            self._backlog.clear()
        return out

    def record(self, snap: HostSnapshot | None = None, events: Iterable[Event] = (),
               engines: Mapping[str, Any] | None = None) -> concurrent.futures.Future:
        """Queue one transaction: this cycle's samples, the events kept since the last one,
        `events`, and `engines` (name -> EngineSnapshot, at the snapshot's time). Returns
        the future (tests wait on it, the daemon does not)."""
        t = snap.time if snap else time.time()
        while self._notices and self.publish is not None:
            self.publish(self._notices.popleft())  # into the backlog (the hub hands it back)
        evs = self._take_backlog() + list(events)
        with self._backlog_lock:
            power, self._power_rows = self._power_rows, {}
        return self._pool.submit(self._write, self.sample_rows(snap) if snap else [], self.event_rows(evs),
                                 self.engine_rows(engines, t), power)

    def record_power(self, power: dict[str, list[tuple]], cycle: bool = False) -> concurrent.futures.Future | None:
        """Queue rows for the power tables ({table: rows}, see POWER_TABLES) in one transaction;
        with `cycle`, in the transaction of the next `record()` instead, which the daemon
        makes right after in the same poll cycle: one commit and one fsync a second, not
        two (issue 15: each is a wakeup of the recorder's thread and a journal write)."""
        unknown = set(power) - set(POWER_TABLES)
        if unknown:
            raise ValueError(f"no recorder table {sorted(unknown)}; power tables: {sorted(POWER_TABLES)}")
        if cycle:
            with self._backlog_lock:
                for table, rows in power.items():
                    self._power_rows.setdefault(table, []).extend(rows)
            return None
        return self._pool.submit(self._write, [], [], [], power)

    def mark_stopped(self, why: str = "gpuguard stopped") -> None:
        """End the recording cleanly: the marker goes in with what still waits (close())."""
        self.add_event(Event("recording_stopped", "info", "recorder",
                             f"{why} cleanly: the recording ends here", fields={"path": self.path}))

    def flush(self) -> None:
        """Wait until everything handed in so far is committed (or counted failed)."""
        if self._backlog:
            self.record()
        self._pool.submit(lambda: None).result()

    def bytes_on_disk(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.stat(self.path + suffix).st_size
            except OSError:
                pass
        return total

    def collect(self) -> Iterable[Metric]:
        fail = CounterMetricFamily("gpuguard_recorder_write_failures", "Flight recorder transactions that failed "
                                   "(disk full, I/O error): their rows are lost")
        fail.add_metric([], self.failures)
        rows = CounterMetricFamily("gpuguard_recorder_rows", "Rows committed to the flight recorder", labels=["table"])
        for table in ("samples", "events"):
            rows.add_metric([table], self.rows[table])
        dropped = CounterMetricFamily("gpuguard_recorder_events_dropped", "Events not recorded because the "
                                      "recorder's backlog was full")
        dropped.add_metric([], self.events_dropped)
        size = GaugeMetricFamily("gpuguard_recorder_bytes", "Flight recorder size on disk (database + WAL)")
        size.add_metric([], self.bytes_on_disk())
        lost = CounterMetricFamily("gpuguard_recorder_file_lost", "Times the flight recording's file was found "
                                   "deleted or replaced while recording: reopened as a new file, the rows of "
                                   "the cycle before lost with the old one")
        lost.add_metric([], self.files_lost)
        yield from (fail, rows, dropped, size, lost)

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._pool.submit(lambda: self._db.execute(sql, args).fetchall()).result()

    def close(self) -> None:
        if self._backlog:
            self.record()  # the events still waiting for a cycle

        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._pool.submit(_close).result()
        self._pool.shutdown(wait=True)
