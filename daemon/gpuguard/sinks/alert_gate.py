"""Which alert-grade events become webhooks, and what a full webhook queue gives up.

Debounce (a kernel flood sent 643 webhooks and dropped 3,365, losing the real
alert behind it): one webhook per condition — event kind, GPU, engine — per window. The
repeats inside the window are counted; the next webhook for that condition carries the
count (`fields.suppressed_repeats`), and `gpuguard_alerts_suppressed_total{kind}` counts
them all. An event whose source policy said "do not alert" (`fields.alert: false`, set
by the kernel router from `kernel.policy`) never becomes a webhook.

The queue keeps the most severe and most recent alerts when full: the oldest of the
least severe events queued is dropped to make room, unless the new one is less severe
than everything queued (then the new one goes). Every drop is counted.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Callable

from gpuguard.state.events import SEVERITIES, Event

RANK = {s: i for i, s in enumerate(SEVERITIES)}


def condition(event: Event) -> tuple:
    return (event.kind, event.gpu or event.bdf, event.engine)


class AlertGate:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._last: dict[tuple, list] = {}  # condition -> [sent_at, suppressed since]
        self.suppressed: collections.Counter[str] = collections.Counter()  # kind -> repeats not sent

    def admit(self, event: Event) -> Event | None:
        """The event to send (with its suppressed-repeat count), or None."""
        if not event.alert_grade or event.fields.get("alert") is False:
            return None
        now = self.clock()
        key = condition(event)
        st = self._last.get(key)
        if st is not None and now - st[0] < self.window_s:
            st[1] += 1
            self.suppressed[event.kind] += 1
            return None
        repeats = st[1] if st is not None else 0
        self._last[key] = [now, 0]
        if len(self._last) > 4096:  # conditions from long ago: forget them
            cutoff = now - self.window_s
            self._last = {k: v for k, v in self._last.items() if v[0] >= cutoff}
        if repeats:
            event = dataclasses.replace(event, fields={**event.fields, "suppressed_repeats": repeats})
        return event


class AlertQueue:
    """A bounded queue that, when full, drops the least severe (oldest first)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: collections.deque[Event] = collections.deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, event: Event) -> Event | None:
        """Queue `event`; returns the event dropped to make room (maybe `event`), else None."""
        dropped = None
        if len(self._items) >= self.maxsize:
            victim = min(self._items, key=lambda e: RANK[e.severity])  # min() keeps the oldest of a rank
            if RANK[event.severity] < RANK[victim.severity]:
                return event
            self._items.remove(victim)
            dropped = victim
        self._items.append(event)
        self._ready.set()
        return dropped

    async def get(self) -> Event:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()
