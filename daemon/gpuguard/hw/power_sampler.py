"""Fast power sampling: one small thread per GPU reads only its power source at 20–50 Hz,
so gpuguard sees the peaks that trip a PSU, not only the once-a-poll value (INCIDENTS §2:
two cards tripped a 1300 W supply at an average of 263 W; the cap regulates the average,
the supply reacts to the peaks).

Owns: the per-GPU sampling threads, their bounded ring of raw samples (for the burst the
flight recorder keeps around a power alert) and the per-interval statistics
(`PowerWindow`: peak, p99, mean, sample count, errors) that the poll cycle takes.

Cheap by construction: a sample is one `read()` of one file (or one NVML call) and a
float parse; nothing else runs on the thread. Each thread measures its own CPU time and
halves its rate (down to `MIN_HZ`) when it spends more than its budget — the daemon's
telemetry must never become the load. A thread per GPU also means one wedged card blocks
only its own sampling; the poller's timeouts still report that card.
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
BUDGET_CHECK_S = 5.0
# A window nobody takes (a wedged poll loop) must not grow without bound: past this many
# samples only the peak and the count move on.
MAX_WINDOW_SAMPLES = 65536


@dataclass(frozen=True)
class PowerChannel:
    """What one GPU's sampler reads. `source` says which sensor it is (`power1_input`,
    `power1_average`, `nvml_power_instant`, `nvml_power_usage`): an averaged sensor shows
    lower peaks than the supply sees, and the reader of a metric must know which it got.
    `read()` returns watts or raises an exception whose text names the file/call."""

    gpu: str
    bdf: str
    source: str
    where: str
    read: Callable[[], float]

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
    """The sampling thread of one GPU."""

    def __init__(self, channel: PowerChannel, hz: float, ring_seconds: float, cpu_budget_ratio: float,
                 wall: Callable[[], float] = time.time) -> None:
        self.channel = channel
        self.hz = float(hz)
        self.configured_hz = float(hz)
        self.cpu_budget_ratio = cpu_budget_ratio
        self.wall = wall
        self.ring: collections.deque[tuple[float, float]] = collections.deque(maxlen=max(1, int(hz * ring_seconds)))
        self._lock = threading.Lock()
        self._values: list[float] = []
        self._peak: float | None = None
        self._count = 0
        self._errors = 0
        self._last_error: str | None = None
        self._window_start = wall()
        self.samples_total = 0
        self.errors_total = 0
        self.cpu_seconds = 0.0  # this thread's own CPU time (time.thread_time)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"gpuguard-power-{channel.gpu}", daemon=True)

    def start(self) -> "GpuSampler":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        read = self.channel.read
        period = 1.0 / self.hz
        next_t = time.monotonic()
        cpu0 = time.thread_time()
        check_cpu, check_t = cpu0, next_t
        while not self._stop.is_set():
            t = self.wall()
            try:
                w = read()
            except Exception as e:  # noqa: BLE001 — any failure is an error for this sample, named
                with self._lock:
                    self._errors += 1
                    self.errors_total += 1
                    self._last_error = f"{type(e).__name__}: {e}"
            else:
                with self._lock:
                    if len(self._values) < MAX_WINDOW_SAMPLES:
                        self._values.append(w)
                    if self._peak is None or w > self._peak:
                        self._peak = w
                    self._count += 1
                    self.ring.append((t, w))
                    self.samples_total += 1
            now = time.monotonic()
            if now - check_t >= BUDGET_CHECK_S:
                cpu = time.thread_time()
                self.cpu_seconds += cpu - check_cpu
                share = (cpu - check_cpu) / (now - check_t)
                if share > self.cpu_budget_ratio and self.hz > MIN_HZ:
                    self.hz = max(MIN_HZ, self.hz / 2)
                    period = 1.0 / self.hz
                    log.warning(
                        "power sampler gpu=%s used %.2f%% of a core (budget %.2f%%) reading %s; rate lowered to %g Hz",
                        self.channel.gpu, share * 100, self.cpu_budget_ratio * 100, self.channel.where, self.hz,
                    )
                check_cpu, check_t = cpu, now
            next_t += period
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a slow read, a loaded host): no catch-up burst
                next_t = time.monotonic()
                delay = 0.0
            self._stop.wait(delay)
        self.cpu_seconds += time.thread_time() - check_cpu

    def take_window(self) -> PowerWindow:
        """The statistics since the last call; starts a new window."""
        end = self.wall()
        with self._lock:
            values, self._values = self._values, []
            peak, self._peak = self._peak, None
            count, self._count = self._count, 0
            errors, self._errors = self._errors, 0
            last_error, self._last_error = self._last_error, None
            start, self._window_start = self._window_start, end
        c = self.channel
        if not values:
            return PowerWindow(c.gpu, c.bdf, c.source, start, end, 0, None, None, None, errors, last_error, self.hz)
        return PowerWindow(c.gpu, c.bdf, c.source, start, end, count, peak, p99(values),
                           sum(values) / len(values), errors, last_error, self.hz)

    def burst(self, since: float | None = None) -> list[tuple[float, float]]:
        """Raw (wall time, watts) samples still in the ring, oldest first."""
        with self._lock:
            return [s for s in self.ring if since is None or s[0] >= since]


class PowerSampler:
    """The set of per-GPU samplers. `sync(channels)` starts a thread for a new or changed
    channel and stops the thread of one that is gone (a lost GPU, a renumbered hwmon)."""

    def __init__(self, hz: float = 20.0, ring_seconds: float = 10.0, cpu_budget_ratio: float = 0.01,
                 wall: Callable[[], float] = time.time) -> None:
        self.hz = hz
        self.ring_seconds = ring_seconds
        self.cpu_budget_ratio = cpu_budget_ratio
        self.wall = wall
        self.samplers: dict[str, GpuSampler] = {}  # gpu name -> sampler
        self._closed = False

    def sync(self, channels: Iterable[PowerChannel]) -> None:
        if self._closed:
            return
        wanted = {c.gpu: c for c in channels}
        for gpu in list(self.samplers):
            s = self.samplers[gpu]
            if gpu not in wanted or wanted[gpu].key() != s.channel.key():
                s.stop()  # a thread stuck in a wedged read ends when the read returns
                del self.samplers[gpu]
        for gpu, c in wanted.items():
            if gpu not in self.samplers:
                log.info("power sampler gpu=%s bdf=%s reads %s (%s) at %g Hz", c.gpu, c.bdf, c.where, c.source, self.hz)
                self.samplers[gpu] = GpuSampler(c, self.hz, self.ring_seconds, self.cpu_budget_ratio, self.wall).start()

    def set_rate(self, hz: float, ring_seconds: float, cpu_budget_ratio: float) -> None:
        """New settings (a reload): the threads stop and the next `sync` starts new ones."""
        if (hz, ring_seconds, cpu_budget_ratio) == (self.hz, self.ring_seconds, self.cpu_budget_ratio):
            return
        self.hz, self.ring_seconds, self.cpu_budget_ratio = hz, ring_seconds, cpu_budget_ratio
        for s in self.samplers.values():
            s.stop()
        self.samplers = {}

    def take_windows(self) -> dict[str, PowerWindow]:
        return {gpu: s.take_window() for gpu, s in self.samplers.items()}

    def burst(self, gpu: str, since: float | None = None) -> list[tuple[float, float]]:
        s = self.samplers.get(gpu)
        return s.burst(since) if s else []

    def close(self, join_timeout: float = 2.0) -> None:
        self._closed = True
        for s in self.samplers.values():
            s.stop()
        deadline = time.monotonic() + join_timeout
        for s in self.samplers.values():
            s.thread.join(max(0.0, deadline - time.monotonic()))
