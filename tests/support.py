"""Helpers shared by tests (importable: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import time
from typing import Callable


def poll_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition", interval: float = 0.02):
    """Poll `cond` until it returns something truthy (returned) or the deadline passes.
    Synchronisation by condition, never by a fixed sleep."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except Exception as e:  # what we wait for may not answer yet
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
