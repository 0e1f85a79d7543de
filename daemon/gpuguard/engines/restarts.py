"""Restart-loop detection (INCIDENTS §7: an engine dying every 4-5 minutes with exit 0).
Pure: start times in, "loop now" out; a detected loop clears the ledger so one loop is
reported once."""
from __future__ import annotations

from collections import deque


class RestartLedger:
    def __init__(self, count: int, window: float) -> None:
        self.count = count
        self.window = window
        self._starts: deque[float] = deque()

    def record_start(self, when: float) -> bool:
        """Record one engine start; True when `count` starts fall within `window` seconds."""
        self._starts.append(when)
        while self._starts and when - self._starts[0] > self.window:
            self._starts.popleft()
        if len(self._starts) >= self.count:
            self._starts.clear()
            return True
        return False

    def recent(self) -> int:
        return len(self._starts)
