"""The hub: the latest host snapshot plus the event stream. Sources publish here; sinks
(metrics, API, recorder, notifier, policy) read the snapshot or subscribe to events.
Nothing here touches hardware, so a scrape or API read never blocks on a device."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from prometheus_client import Histogram

from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuStates
from gpuguard.state.snapshot import GpuSnapshot


@dataclass(frozen=True)
class HostSnapshot:
    """Everything the GPU poller knew after one cycle."""

    time: float
    gpus: tuple[GpuSnapshot, ...] = ()
    duration_seconds: float = 0.0

    def gpu(self, name_or_bdf: str) -> GpuSnapshot | None:
        for g in self.gpus:
            if g.name == name_or_bdf or g.bdf == name_or_bdf:
                return g
        return None


@dataclass
class Counters:
    """Monotonic counters the metrics sink exports (`*_total`)."""

    poll_errors: collections.Counter = field(default_factory=collections.Counter)  # (gpu, source)
    # kernel event counters live with the GPU state (hub.gpus.kernel_counts)
    # Unregistered: the metrics sink collects it from here, so tests get a fresh one per hub.
    poll_duration: Histogram = field(
        default_factory=lambda: Histogram(
            "gpuguard_poll_duration_seconds",
            "Wall time of one poll cycle per source",
            ["source"],
            registry=None,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
    )


class Hub:
    def __init__(self, event_history: int = 1000) -> None:
        self.snapshot: HostSnapshot | None = None
        self.last_poll: dict[str, float] = {}  # source -> wall time of last finished cycle
        self.counters = Counters()
        self.events: collections.deque[Event] = collections.deque(maxlen=event_history)
        # Other sources' latest state (pcie report, engine snapshots, profile status),
        # keyed by source name; each value is immutable.
        self._views: dict[str, Any] = {}
        self._subscribers: list[Callable[[Event], None]] = []
        self._revisers: list[Callable[[Event, Event], None]] = []
        # The one owner of every GPU's identity and lifecycle (lost, back, profile state).
        self.gpus = GpuStates(self.publish)
        # One short note per source for the one-line summary (systemd STATUS=, /v1/status):
        # "profile unverified: xtx-0 (mismatch)", "engine stalled: sglang". Empty = nothing.
        self.notes: dict[str, str] = {}
        self._queues: list[asyncio.Queue] = []
        # /healthz: a poll cycle must have finished within this (interval + timeout + 1 s);
        # None: any finished cycle will do
        self.poll_budget_seconds: float | None = None

    # -- snapshots -------------------------------------------------------------------
    def publish_snapshot(self, snap: HostSnapshot, source: str = "gpu") -> None:
        self.snapshot = snap
        self.last_poll[source] = snap.time

    def poll_fresh(self, now: float | None = None) -> bool:
        """True when the GPU poll loop finished a cycle recently enough (/healthz
        said ok while nothing had been polled for 40 s)."""
        last = self.last_poll.get("gpu")
        if last is None:
            return False
        if self.poll_budget_seconds is None:
            return True
        return (now if now is not None else time.time()) - last <= self.poll_budget_seconds

    def set_view(self, source: str, value: Any) -> None:
        self._views[source] = value
        self.last_poll[source] = time.time()

    def view(self, source: str, default: Any = None) -> Any:
        return self._views.get(source, default)

    @property
    def views(self) -> Mapping[str, Any]:
        return MappingProxyType(self._views)

    # -- events ----------------------------------------------------------------------
    def publish(self, event: Event) -> None:
        self.events.append(event)
        for fn in list(self._subscribers):
            fn(event)
        for q in list(self._queues):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                pass  # a slow consumer loses events, the hub never blocks

    def revise(self, old: Event, new: Event) -> None:
        """`new` stands for the published `old` from now on (repeats counted into it, see
        kernel/router.py): replaced in the event list, handed to `on_revise` listeners
        (the recorder). Not published again: no second webhook, no second log line."""
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i] is old:
                self.events[i] = new
                break
        for fn in list(self._revisers):
            fn(old, new)

    def on_revise(self, fn: Callable[[Event, Event], None]) -> None:
        """Call `fn(old, new)` when an event is revised (must not block)."""
        self._revisers.append(fn)

    def on_event(self, fn: Callable[[Event], None]) -> None:
        """Call `fn(event)` synchronously for every event (must not block)."""
        self._subscribers.append(fn)

    def subscribe(self, maxsize: int = 1000) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self._queues.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        if q in self._queues:
            self._queues.remove(q)

    def recent_events(self, since: float | None = None) -> list[Event]:
        return [e for e in self.events if since is None or e.time >= since]
