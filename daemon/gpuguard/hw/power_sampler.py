"""Fast power sampling: one thread reads every GPU's power source in turn at 20–50 Hz,
so gpuguard sees the peaks that trip a PSU, not only the once-a-poll value (INCIDENTS §2:
two cards tripped a 1300 W supply at an average of 263 W; the cap regulates the average,
the supply reacts to the peaks).

Owns: the sampling threads, each GPU's bounded ring of raw samples (for the burst the
flight recorder keeps around a power alert) and the per-interval statistics
(`PowerWindow`: peak, p99, mean, sample count, errors) that the poll cycle takes.

Cheap by construction: a sample is one `pread()` of a file held open (or one NVML call)
and a float parse, appended to a list without a lock (a window takes the samples counted
so far off its front). One thread for all GPUs, not one per GPU: a wakeup costs more than the read (on
the 2-core CI VM ~100 µs against ~10 µs), and four per-GPU threads contending for the GIL
cost 3–4× one thread reading the same four files; the GPUs of one tick are also read
within the same millisecond, which is what a supply sees summed. Ticks fall on multiples
of the period (of the monotonic clock), and the poll's ticks on multiples of its interval
(poller.py), so the once-a-second work runs in a wakeup the sampler pays for anyway: on a
virtual machine a thread woken from idle costs 100-250 µs before it does anything, most
of the daemon's idle CPU (issue 15). While every GPU is at rest (under a line the
power watch sets from its cap) the thread ticks once a second (`REST_HZ`). The thread measures its
own CPU time and halves its rate (down to `MIN_HZ`) when it spends more than its budget —
the daemon's telemetry must never become the load.

A wedged card must not stop the others' sampling: each interval (`take_windows`) and each
`sync` look for a read that has been in progress longer than `STUCK_AFTER_S`; that GPU
stays alone on the stuck thread and the others move to a new one. A wedged card costs
the other GPUs at most one poll interval of samples.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

log = logging.getLogger("gpuguard.power")

MIN_HZ = 2.0
# With every GPU under its rest line (PowerSampler.set_rest_lines) for `rest_after_s`, the
# thread ticks once a second, on the whole second where the poll wakes anyway: an idle
# inference host then pays one wakeup a second for the sampler, not 20 (issue 15). A GPU
# drawing a fifth of its cap cannot put a supply at risk; the first reading over its line
# brings the full rate back at the next tick (at most a second after the load starts).
REST_HZ = 1.0
BUDGET_CHECK_S = 5.0
# A window nobody takes (a wedged poll loop) must not grow without bound: past this many
# samples only the peak and the count move on.
MAX_WINDOW_SAMPLES = 65536
# A read in progress this long (or two periods, if longer) is a wedged card.
STUCK_AFTER_S = 0.5


@dataclass(frozen=True)
class PowerChannel:
    """What one GPU's sampler reads. `source` says which sensor it is (`power1_input`,
    `power1_average`, `nvml_power_instant`, `nvml_power_usage`): an averaged sensor shows
    lower peaks than the supply sees, and the reader of a metric must know which it got.
    `read()` returns watts or raises an exception whose text names the file/call; `close()`
    lets go of what `read` holds (a file), called by the thread that read it."""

    gpu: str
    bdf: str
    source: str
    where: str
    read: Callable[[], float]
    close: Callable[[], None] = lambda: None

    def key(self) -> tuple:
        return (self.gpu, self.bdf, self.source, self.where)


@dataclass(frozen=True)
class PowerWindow:
    """One GPU's samples over one poll interval. `samples == 0` means nothing was read in
    that interval: the peak/p99/mean are then None (absent, never a zero)."""

    gpu: str
    bdf: str
    source: str
    start: float  # wall time
    end: float
    samples: int
    peak_w: float | None
    p99_w: float | None
    mean_w: float | None
    errors: int = 0
    last_error: str | None = None
    hz: float = 0.0  # the rate the thread runs at now (lower than configured = over budget)

    @property
    def peak_to_mean(self) -> float | None:
        if self.peak_w is None or not self.mean_w:
            return None
        return self.peak_w / self.mean_w

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu, "bdf": self.bdf, "source": self.source, "start": self.start, "end": self.end,
            "samples": self.samples, "peak_watts": self.peak_w, "p99_watts": self.p99_w, "mean_watts": self.mean_w,
            "errors": self.errors, "last_error": self.last_error, "hz": self.hz,
        }


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (with fewer than 100 samples it is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class GpuSampler:
    """One GPU's samples: the open window, the ring, its counters. A `_SamplerThread`
    drives it; `thread` is the thread that reads it now."""

    def __init__(self, channel: PowerChannel, hz: float, ring_seconds: float, cpu_budget_ratio: float,
                 wall: Callable[[], float] = time.time) -> None:
        self.channel = channel
        self.hz = float(hz)
        self.configured_hz = float(hz)
        self.cpu_budget_ratio = cpu_budget_ratio
        self.wall = wall
        self.ring: collections.deque[tuple[float, float]] = collections.deque(maxlen=max(1, int(hz * ring_seconds)))
        self._lock = threading.Lock()  # the error counters and the window's overflow
        # appended by the reading thread; take_window takes the first n and deletes them
        # (one list for good: a swapped list could still get the append of a reader that
        # had loaded it before the swap, after its window was counted)
        self._values: list[float] = []
        self._over_peak: float | None = None  # past MAX_WINDOW_SAMPLES: only the peak and count
        self._over_count = 0
        self._errors = 0
        self._last_error: str | None = None
        self._window_start = wall()
        self.samples_total = 0
        self.errors_total = 0
        # the last reading and the line under which this GPU is at rest (None: unknown, so
        # never at rest); read by the sampling thread to choose its rate
        self.last_w: float | None = None
        self.rest_w: float | None = None
        self.cpu_seconds = 0.0  # its share of the sampling thread's CPU time (time.thread_time)
        self.stopped = False
        self.driver: _SamplerThread | None = None

    @property
    def thread(self) -> threading.Thread:
        assert self.driver is not None, "not started"
        return self.driver.thread

    def start(self) -> "GpuSampler":
        """Sample on a thread of its own (PowerSampler puts GPUs on one shared thread)."""
        _SamplerThread([self], self.hz, self.cpu_budget_ratio).start()
        return self

    def stop(self) -> None:
        """No more samples; a thread left with nothing to read ends (one stuck in a wedged
        read ends when the read returns)."""
        self.stopped = True
        if self.driver is not None:
            self.driver.changed = True

    def sample(self, t: float | None = None) -> None:
        """One reading, at wall time `t` (the tick's, shared by its GPUs)."""
        if t is None:
            t = self.wall()
        try:
            w = self.channel.read()
        except Exception as e:  # noqa: BLE001 — any failure is an error for this sample, named
            with self._lock:
                self._errors += 1
                self.errors_total += 1
                self._last_error = f"{type(e).__name__}: {e}"
            self.last_w = None  # a sensor that fails is not known to rest
            return
        self.last_w = w
        values = self._values
        if len(values) < MAX_WINDOW_SAMPLES:
            # no lock: list.append is atomic and only adds at the end, past what
            # take_window has counted
            values.append(w)
        else:
            with self._lock:
                self._over_count += 1
                if self._over_peak is None or w > self._over_peak:
                    self._over_peak = w
        self.ring.append((t, w))
        self.samples_total += 1  # one writer: the reading thread

    def take_window(self) -> PowerWindow:
        """The statistics since the last call; starts a new window."""
        end = self.wall()
        n = len(self._values)
        values = self._values[:n]
        del self._values[:n]
        with self._lock:
            over_peak, self._over_peak = self._over_peak, None
            over_count, self._over_count = self._over_count, 0
            errors, self._errors = self._errors, 0
            last_error, self._last_error = self._last_error, None
            start, self._window_start = self._window_start, end
        c = self.channel
        if not values:
            return PowerWindow(c.gpu, c.bdf, c.source, start, end, 0, None, None, None, errors, last_error, self.hz)
        peak = max(values)
        if over_peak is not None and over_peak > peak:
            peak = over_peak
        return PowerWindow(c.gpu, c.bdf, c.source, start, end, len(values) + over_count, peak, p99(values),
                           sum(values) / len(values), errors, last_error, self.hz)

    def burst(self, since: float | None = None) -> list[tuple[float, float]]:
        """Raw (wall time, watts) samples still in the ring, oldest first."""
        ring = list(self.ring)  # a copy first: the reading thread appends meanwhile
        return [s for s in ring if since is None or s[0] >= since]


class _SamplerThread:
    """Reads its GPUs one after another every 1/hz seconds. `members` is replaced, never
    mutated, so the thread iterates a consistent tuple while another thread re-homes GPUs."""

    _n = 0

    def __init__(self, members: list[GpuSampler], hz: float, cpu_budget_ratio: float,
                 rest_after_s: float | None = None) -> None:
        self.members: tuple[GpuSampler, ...] = tuple(members)
        self.hz = float(hz)  # the full rate (halved when over budget)
        self.rate = self.hz  # the rate it runs at now: hz, or REST_HZ while every GPU rests
        self.rest_after_s = rest_after_s  # None: never rests
        self.cpu_budget_ratio = cpu_budget_ratio
        self.reading: GpuSampler | None = None  # the GPU whose read is in progress
        self.reading_since = 0.0  # monotonic
        self._end_lock = threading.Lock()
        self.ended = False
        self.changed = False  # a member stopped: drop it at the next tick
        _SamplerThread._n += 1
        self.thread = threading.Thread(target=self._run, name=f"gpuguard-power-{_SamplerThread._n}", daemon=True)
        for m in self.members:
            m.driver = self
            m.hz = self.hz

    def start(self) -> "_SamplerThread":
        self.thread.start()
        return self

    def add(self, new: list[GpuSampler]) -> bool:
        """Take more GPUs; False when the thread has ended (or is ending) and cannot."""
        with self._end_lock:
            if self.ended:
                return False
            for m in new:
                m.driver = self
                m.hz = self.rate
            self.members = self.members + tuple(new)
            return True

    def stuck(self, now: float) -> GpuSampler | None:
        r = self.reading
        return r if r is not None and now - self.reading_since > max(STUCK_AFTER_S, 2.0 / self.hz) else None

    def at_rest(self, members: tuple[GpuSampler, ...]) -> bool:
        """Every GPU's last reading under its rest line (a GPU without a line, or whose
        read failed, is not at rest)."""
        for m in members:
            w, line = m.last_w, m.rest_w
            if w is None or line is None or w >= line:
                return False
        return True

    def _run(self) -> None:
        monotonic, sleep, wall = time.monotonic, time.sleep, time.time
        period = 1.0 / self.hz
        next_t = on_grid(monotonic(), period)
        resting = False
        working_t = monotonic()  # the last tick that found a GPU over its line
        check_cpu, check_t = time.thread_time(), monotonic()
        last: tuple[GpuSampler, ...] = self.members
        try:
            while True:
                members = self.members
                if self.changed:
                    self.changed = False
                    last = members
                    with self._end_lock:
                        self.members = members = tuple(m for m in self.members if not m.stopped)
                        for m in last:
                            if m.stopped:
                                m.channel.close()
                        if not members:
                            self.ended = True
                            break
                self.reading_since = now = monotonic()
                t = wall()
                for m in members:
                    self.reading = m
                    m.sample(t)
                self.reading = None
                if self.rest_after_s is not None:
                    if not self.at_rest(members):
                        working_t = now
                        if resting:  # work again: the full rate from the next tick of its grid
                            resting = False
                            self.rate = self.hz
                            period = 1.0 / self.hz
                            next_t = on_grid(now, period) - period
                            for m in members:
                                m.hz = self.hz
                    elif not resting and now - working_t >= self.rest_after_s:
                        resting = True
                        self.rate = REST_HZ
                        period = 1.0 / REST_HZ
                        next_t = on_grid(now, period) - period
                        for m in members:
                            m.hz = REST_HZ
                if now - check_t >= BUDGET_CHECK_S:
                    cpu = time.thread_time()
                    share = (cpu - check_cpu) / (now - check_t)
                    for m in members:
                        m.cpu_seconds += (cpu - check_cpu) / len(members)
                    # the budget is per GPU: a thread reading n GPUs may spend n shares
                    if share > self.cpu_budget_ratio * len(members) and self.hz > MIN_HZ and not resting:
                        self.hz = self.rate = max(MIN_HZ, self.hz / 2)
                        period = 1.0 / self.hz
                        for m in members:
                            m.hz = self.hz
                        log.warning(
                            "power sampler gpus=%s used %.2f%% of a core (budget %.2f%% per GPU); rate lowered to %g Hz",
                            ",".join(m.channel.gpu for m in members), share * 100, self.cpu_budget_ratio * 100, self.hz,
                        )
                    check_cpu, check_t = cpu, now
                next_t += period
                delay = next_t - monotonic()
                if delay < 0:  # fell behind (a slow read, a loaded host): no catch-up burst
                    next_t = on_grid(monotonic(), period)
                    delay = next_t - monotonic()
                # time.sleep, not Event.wait: a timed Event.wait builds a lock and a condition
                # round trip per call, twice the cost of the read itself; a stop waits at most
                # one period (close() joins)
                sleep(max(0.0, delay))
        finally:
            cpu = time.thread_time() - check_cpu
            for m in last:  # the GPUs it read last: the time since the last check is theirs
                m.cpu_seconds += cpu / len(last)
            for m in self.members:
                if m.stopped:
                    m.channel.close()


def on_grid(now: float, period: float) -> float:
    """The first multiple of `period` after `now`: every periodic wakeup of the daemon
    lands on the same instants (the sampler's ticks, the poll's), and one wakeup serves
    all of them."""
    return (math.floor(now / period) + 1) * period


class PowerSampler:
    """The per-GPU samplers and the threads that drive them. `sync(channels)` adds a new or
    changed channel to the shared thread and stops one that is gone (a lost GPU, a
    renumbered hwmon)."""

    def __init__(self, hz: float = 20.0, ring_seconds: float = 10.0, cpu_budget_ratio: float = 0.01,
                 wall: Callable[[], float] = time.time, rest_after_s: float | None = None) -> None:
        self.hz = hz
        self.rest_after_s = rest_after_s  # None: the full rate always
        self.rest_lines: dict[str, float] = {}
        self.ring_seconds = ring_seconds
        self.cpu_budget_ratio = cpu_budget_ratio
        self.wall = wall
        self.samplers: dict[str, GpuSampler] = {}  # gpu name -> sampler
        self._shared: _SamplerThread | None = None  # where new GPUs go
        self._threads: list[_SamplerThread] = []
        self._lock = threading.Lock()
        self._closed = False

    def sync(self, channels: Iterable[PowerChannel]) -> None:
        with self._lock:
            if self._closed:
                return
            wanted = {c.gpu: c for c in channels}
            for gpu in list(self.samplers):
                s = self.samplers[gpu]
                if gpu not in wanted or wanted[gpu].key() != s.channel.key():
                    s.stop()
                    del self.samplers[gpu]
            new = []
            for gpu, c in wanted.items():
                if gpu not in self.samplers:
                    log.info("power sampler gpu=%s bdf=%s reads %s (%s) at %g Hz", c.gpu, c.bdf, c.where, c.source, self.hz)
                    s = self.samplers[gpu] = GpuSampler(c, self.hz, self.ring_seconds, self.cpu_budget_ratio, self.wall)
                    s.rest_w = self.rest_lines.get(gpu)
                    new.append(s)
            self._rehome_stuck()
            if new and not (self._shared is not None and self._shared.add(new)):
                self._move(new)
            self._threads = [t for t in self._threads if t.thread.is_alive()]

    def _move(self, members: list[GpuSampler]) -> None:
        """Put `members` on a new shared thread (the old one, if any, keeps only what is
        not moved: a stuck GPU, or nothing, and then it ends)."""
        old = self._shared
        t = _SamplerThread(members, self.hz, self.cpu_budget_ratio, self.rest_after_s)
        if old is not None:
            moved = {id(m) for m in members}
            old.members = tuple(m for m in old.members if id(m) not in moved)
        self._shared = t.start()
        self._threads.append(t)

    def _rehome_stuck(self) -> None:
        now = time.monotonic()
        shared = self._shared
        if shared is None:
            return
        stuck = shared.stuck(now)
        if stuck is None:
            return
        others = [m for m in shared.members if m is not stuck and not m.stopped]
        log.warning("power sampler gpu=%s: a read of %s has not returned for %.1f s; the other GPUs go on "
                    "on a new thread", stuck.channel.gpu, stuck.channel.where, now - shared.reading_since)
        if others:
            self._move(others)
        shared.members = (stuck,)
        self._shared = self._shared if others else None

    def set_rest_lines(self, lines: dict[str, float]) -> None:
        """Each GPU's rest line in watts (a GPU left out has none and is never at rest)."""
        self.rest_lines = dict(lines)
        for gpu, s in list(self.samplers.items()):
            s.rest_w = lines.get(gpu)

    def set_rate(self, hz: float, ring_seconds: float, cpu_budget_ratio: float,
                 rest_after_s: float | None = None) -> None:
        """New settings (a reload): the threads stop and the next `sync` starts new ones."""
        if (hz, ring_seconds, cpu_budget_ratio, rest_after_s) == (self.hz, self.ring_seconds, self.cpu_budget_ratio,
                                                                  self.rest_after_s):
            return
        with self._lock:
            self.hz, self.ring_seconds, self.cpu_budget_ratio = hz, ring_seconds, cpu_budget_ratio
            self.rest_after_s = rest_after_s
            for s in self.samplers.values():
                s.stop()
            self.samplers = {}
            self._shared = None

    def take_windows(self) -> dict[str, PowerWindow]:
        with self._lock:
            self._rehome_stuck()
        return {gpu: s.take_window() for gpu, s in list(self.samplers.items())}

    def burst(self, gpu: str, since: float | None = None) -> list[tuple[float, float]]:
        s = self.samplers.get(gpu)
        return s.burst(since) if s else []

    def close(self, join_timeout: float = 2.0) -> None:
        with self._lock:
            self._closed = True
            for s in self.samplers.values():
                s.stop()
            threads = list(self._threads)
        deadline = time.monotonic() + join_timeout
        for t in threads:
            t.thread.join(max(0.0, deadline - time.monotonic()))
