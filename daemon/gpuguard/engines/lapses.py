"""Time the watchdog did not observe: the daemon itself stopped (SIGSTOP, Ctrl-Z on its
process group, a paused VM, an event loop held up) or the host suspended. Such time is no
engine's lack of progress: a kill is for an engine seen stuck (INCIDENTS §1), never for
one nobody was watching (the demo, paused 172 s, killed its healthy engine on resume).

Two measures, each blind where the other sees:
- lateness: a ticker on the event loop expects to run every `tick`; the first note after a
  stop (the ticker's or an observation's) finds the time it did not run. CLOCK_MONOTONIC
  does not advance while the host is suspended, so this misses a suspend;
- suspend: CLOCK_BOOTTIME advances during a suspend, CLOCK_MONOTONIC does not; their
  difference grows by the time suspended (the wall clock the stall state machine is fed
  jumps by as much)."""
from __future__ import annotations

import asyncio
import time
from typing import Callable

TICK = 0.25  # seconds between the ticker's notes
# Shorter gaps are scheduling noise on a loaded host (a few hundred ms on 2 busy cores):
# restarting the stall clock for those would postpone a real stall's kill for nothing.
LEAST = 2.0


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Lapses:
    """Counts unobserved time. `note()` at every observation; `run()` is the ticker
    (without it, as when polls are driven one by one, only a suspend is seen)."""

    def __init__(self, *, tick: float = TICK, least: float = LEAST,
                 monotonic: Callable[[], float] = time.monotonic, boot: Callable[[], float] = boottime) -> None:
        self.tick, self.least = tick, least
        self._monotonic, self._boot = monotonic, boot
        self.watching = False  # the ticker runs: a late note is time we did not run
        m = monotonic()
        self._last = m
        self._suspend_base = boot() - m
        self.total = 0.0  # unobserved seconds found so far
        self.count = 0
        self.last: dict | None = None  # the latest lapse: {"seconds", "late", "suspended"}

    def note(self) -> float:
        """-> the unobserved seconds found now (0 when none, or under `least`)."""
        m, b = self._monotonic(), self._boot()
        late = max(0.0, m - self._last - self.tick) if self.watching else 0.0
        suspended = max(0.0, (b - m) - self._suspend_base)
        self._last, self._suspend_base = m, b - m
        seconds = late + suspended
        if seconds < self.least:
            return 0.0
        self.total += seconds
        self.count += 1
        self.last = {"seconds": round(seconds, 3), "late": round(late, 3), "suspended": round(suspended, 3)}
        return seconds

    async def run(self) -> None:
        self._last = self._monotonic()
        self.watching = True
        try:
            while True:
                await asyncio.sleep(self.tick)
                self.note()
        finally:
            self.watching = False
