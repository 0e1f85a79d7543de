"""The GPU poller: every `poll.interval_seconds` it reads every GPU once and publishes
one immutable HostSnapshot to the hub.

Reads run off the event loop with a per-GPU timeout (the answering GPUs one after another
on one device thread, see `_read_all`), so a wedged device never freezes the event loop;
a read still stuck from an earlier cycle is not resubmitted (the GPU is reported down with
the reason) so stuck threads cannot pile up. One GPU failing never
stops the others. Discovery runs on its own slower clock (and on request, e.g. from a
udev event) so late cards are picked up and lost ones reported.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Iterable, Protocol, Sequence

from gpuguard.hw.device_calls import DeviceCalls
from gpuguard.hw import plausible
from gpuguard.hw.power_sampler import on_grid
from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot, Hub
from gpuguard.state.snapshot import GpuSnapshot

log = logging.getLogger("gpuguard.poller")


class GpuDevice(Protocol):
    bdf: str
    vendor: str
    device_id: str
    model: str
    driver: str


class GpuSource(Protocol):
    """One vendor's hardware access (amdgpu sysfs, NVML). Both calls block."""

    name: str

    def discover(self) -> Sequence[GpuDevice]: ...

    def read(self, dev: Any, name: str) -> GpuSnapshot: ...


def _down(dev: GpuDevice, name: str, reason: str, key: str = "read", card: str | None = None) -> GpuSnapshot:
    return GpuSnapshot(
        name=name,
        bdf=dev.bdf,
        vendor=dev.vendor,
        device_id=dev.device_id,
        driver=getattr(dev, "driver", "?"),
        model=getattr(dev, "model", "?"),
        card=card or getattr(dev, "card", None),
        up=False,
        time=time.time(),
        errors={key: reason},
    )


class _Batch:
    """GPUs read in order on one thread. `give_up()` (the loop side, at the deadline) takes
    the ones not started yet away from it and names the one it is stuck in."""

    def __init__(self, bdfs: list[str], read: Callable[[str], GpuSnapshot]) -> None:
        self.bdfs = bdfs
        self.read = read
        self.lock = threading.Lock()
        self.results: dict[str, tuple[bool, Any]] = {}  # bdf -> (ok, snapshot or exception)
        self.running: str | None = None
        self.next = 0
        self.closed = False

    def run(self) -> None:
        while True:
            with self.lock:
                if self.closed or self.next >= len(self.bdfs):
                    self.running = None
                    return
                bdf = self.running = self.bdfs[self.next]
                self.next += 1
            try:
                r: tuple[bool, Any] = (True, self.read(bdf))
            except Exception as e:  # handed to the loop side, which names the GPU
                r = (False, e)
            with self.lock:
                if not self.closed:
                    self.results[bdf] = r
                self.running = None

    def give_up(self) -> tuple[str | None, list[str]]:
        with self.lock:
            self.closed = True
            return self.running, self.bdfs[self.next:]

    def done_flag(self, bdf: str) -> "_Returned":
        return _Returned(self, bdf)


class _Returned:
    """`done()` once the batch's thread is out of `bdf`'s read (the poller does not send
    a card another read while one is stuck in it)."""

    def __init__(self, batch: _Batch, bdf: str) -> None:
        self.batch, self.bdf = batch, bdf

    def done(self) -> bool:
        with self.batch.lock:
            return self.batch.running != self.bdf


class GpuPoller:
    """Discovery and reads. What a GPU *is* (name, lost, back) is decided by the hub's
    GpuStates (`hub.gpus`); the poller only reports what it saw."""

    def __init__(
        self,
        hub: Hub,
        sources: Iterable[GpuSource],
        gpu_entries: Iterable | None = None,
        interval: float = 1.0,
        timeout: float = 2.0,
        discover_every: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hub = hub
        self.gpus = hub.gpus
        if gpu_entries is not None:
            self.gpus.configure(list(gpu_entries))
        self.sources = list(sources)
        self.interval = interval
        self.timeout = timeout
        self.discover_every = discover_every
        self.clock = clock
        self.devices: dict[str, tuple[GpuSource, GpuDevice]] = {}  # bdf -> (source, device), last seen
        self._last_discover = float("-inf")
        self._discover_requested = asyncio.Event()
        self._stuck: dict[str, concurrent.futures.Future] = {}
        # daemon threads: a read stuck in a wedged card is abandoned at stop (hw/device_calls.py)
        self.calls = DeviceCalls("gpuguard-read")
        self.cycles = 0
        self.last_cycle_end: float | None = None  # monotonic; /healthz reads it
        self.on_cycle: list[Callable[[HostSnapshot], None]] = []  # e.g. the systemd watchdog ping

    @property
    def names(self) -> dict[str, str]:
        """bdf -> name, read from the GPU state owner (kept for callers that read it here)."""
        return self.gpus.names()

    def request_discovery(self) -> None:
        """Ask for a discovery at the next cycle (a udev add/remove arrived)."""
        self._discover_requested.set()

    async def _run_blocking(self, fn, *args, timeout: float | None = None):
        return await self.calls.run(fn, *args, timeout=timeout or self.timeout)

    async def _unchanged(self, source: GpuSource, unchanged: Callable[[], bool]) -> bool:
        try:
            return bool(await self._run_blocking(unchanged))
        except Exception as e:  # noqa: BLE001 — then look the long way
            log.warning("discovery source=%s: cannot tell whether its GPUs changed (%s: %s); walking the bus",
                        source.name, type(e).__name__, e)
            return False

    async def discover(self, forced: bool = True) -> None:
        found: dict[str, tuple[GpuSource, GpuDevice]] = {}
        for source in self.sources:
            unchanged = getattr(source, "unchanged", None)
            if not forced and unchanged is not None and await self._unchanged(source, unchanged):
                # the periodic look, and the source says nothing came or went: its GPUs stay
                found.update({b: sd for b, sd in self.devices.items() if sd[0] is source and self.gpus.on_bus(b)})
                continue
            try:
                devs = await self._run_blocking(source.discover, timeout=max(self.timeout, 5.0))
            except asyncio.TimeoutError:
                log.error("discovery source=%s timed out; keeping the GPUs it had", source.name)
                found.update({b: sd for b, sd in self.devices.items() if sd[0] is source and self.gpus.on_bus(b)})
                continue
            except Exception as e:  # a broken source must not stop the others
                log.error("discovery source=%s failed: %s", source.name, e)
                found.update({b: sd for b, sd in self.devices.items() if sd[0] is source and self.gpus.on_bus(b)})
                continue
            for d in devs:
                found[d.bdf] = (source, d)
        # a vanished card stays (reported down: "gone from the PCI bus") until it is back
        # or identified elsewhere; the state owner decides which
        self.devices = {**self.devices, **found}
        self.gpus.observe([d for _, d in found.values()])
        self.devices = {b: sd for b, sd in self.devices.items() if b in self.gpus}
        self._last_discover = self.clock()
        self._discover_requested.clear()

    def _read_blocking(self, bdf: str) -> GpuSnapshot:
        source, dev = self.devices[bdf]
        # hw/plausible.py: an implausible value from any source is unreadable, never exported
        return plausible.screen(source.read(dev, self.gpus.name(bdf) or bdf))

    def _failed(self, bdf: str, e: BaseException) -> GpuSnapshot:
        _, dev = self.devices[bdf]
        name = self.gpus.name(bdf) or bdf
        # the reader should not raise; if it does, name the GPU
        log.error("read gpu=%s bdf=%s failed: %s: %s", name, bdf, type(e).__name__, e)
        return _down(dev, name, f"{type(e).__name__}: {e}")

    async def _read_all(self, bdfs: list[str]) -> list[GpuSnapshot]:
        """Every GPU's read. Healthy cards are read one after another on ONE device thread:
        a thread handoff costs more than a card's ~25 reads (each wakeup of a worker and of
        the loop is ~100 µs on a small VM; one per GPU per second was most of an idle
        daemon's CPU). A card that does not answer within `timeout` is left to its thread
        (reported not answering); the cards not read yet go out one per thread, so a
        second wedged card in the same cycle costs no more than the first."""
        out: dict[str, GpuSnapshot] = {}
        todo: list[str] = []
        for bdf in bdfs:
            _, dev = self.devices[bdf]
            name = self.gpus.name(bdf) or bdf
            if not self.gpus.on_bus(bdf):
                out[bdf] = _down(dev, name, "gone from the PCI bus", "device")
                continue
            stuck = self._stuck.get(bdf)
            if stuck is not None:
                if not stuck.done():
                    out[bdf] = _down(dev, name, f"an earlier read is still stuck (> {self.timeout:g} s); device not answering")
                    continue
                del self._stuck[bdf]
            todo.append(bdf)
        if todo:
            batch = _Batch(todo, self._read_blocking)
            cf = self.calls.submit(batch.run)
            try:
                await asyncio.wait_for(asyncio.wrap_future(cf), self.timeout)
            except asyncio.TimeoutError:
                hung, rest = batch.give_up()
                if hung is not None:
                    self._stuck[hung] = batch.done_flag(hung)
                    _, dev = self.devices[hung]
                    out[hung] = _down(dev, self.gpus.name(hung) or hung,
                                      f"read timed out after {self.timeout:g} s; device not answering")
                out.update(zip(rest, await asyncio.gather(*(self._read_alone(b) for b in rest))))
            for bdf, (ok, value) in batch.results.items():
                out[bdf] = value if ok else self._failed(bdf, value)
        return [out[b] for b in bdfs]

    async def _read_alone(self, bdf: str) -> GpuSnapshot:
        cf = self.calls.submit(self._read_blocking, bdf)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(cf), self.timeout)
        except asyncio.TimeoutError:
            self._stuck[bdf] = cf
            _, dev = self.devices[bdf]
            return _down(dev, self.gpus.name(bdf) or bdf, f"read timed out after {self.timeout:g} s; device not answering")
        except Exception as e:
            return self._failed(bdf, e)

    async def poll_once(self) -> HostSnapshot:
        t0 = time.perf_counter()
        if self._discover_requested.is_set():
            await self.discover()
        elif self.clock() - self._last_discover >= self.discover_every:
            await self.discover(forced=False)
        bdfs = sorted(self.devices)
        snaps = await self._read_all(bdfs)
        for s in snaps:
            for _key in s.errors:
                self.hub.counters.poll_errors[(s.name, self.devices[s.bdf][0].name)] += 1
            if s.up:
                self.gpus.answering(s.bdf)
            elif self.gpus.on_bus(s.bdf):
                self.gpus.not_answering(s.bdf, "; ".join(s.errors.values()) or "down")
            # a device whose files vanished mid-read, or whose hwmon index changed: look
            # again at the next cycle
            if (not s.up and "device" in s.errors and self.gpus.on_bus(s.bdf)) or s.extra.get("rediscover"):
                self._discover_requested.set()
        duration = time.perf_counter() - t0
        snap = HostSnapshot(time=time.time(), gpus=tuple(snaps), duration_seconds=duration)
        self.hub.counters.poll_duration.labels("gpu").observe(duration)
        self.hub.publish_snapshot(snap, "gpu")
        self.cycles += 1
        self.last_cycle_end = time.monotonic()
        for fn in self.on_cycle:
            try:
                fn(snap)
            except Exception:  # one listener must not end the cycle for the others
                log.exception("poll cycle listener %s failed", getattr(fn, "__qualname__", fn))
        return snap

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        # cycles on multiples of the interval (of the monotonic clock, which is the loop's):
        # the power sampler ticks on multiples of its period too, so a cycle starts in a
        # wakeup the host pays for anyway (hw/power_sampler.on_grid)
        next_at: float | None = None  # the first cycle at once
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception:  # never let one bad cycle end the poller
                log.exception("poll cycle failed")
            now = loop.time()
            next_at = on_grid(now, self.interval) if next_at is None else next_at + self.interval
            if next_at < now:  # fell behind: don't try to catch up in a burst
                next_at = on_grid(now, self.interval)
            delay = next_at - now
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def close(self) -> None:
        self.calls.close()
