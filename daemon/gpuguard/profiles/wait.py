"""Waiting for the expected number of GPUs before applying (INCIDENTS §2: the boot
service ran before the second card's sysfs node existed; the glob matched one card).
On timeout the result names the configured GPUs that are missing."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable


@dataclass(frozen=True)
class WaitResult:
    wanted: int
    present: tuple[str, ...]  # names of the GPUs found
    missing: tuple[str, ...]  # configured names not found (may be fewer than wanted - found)
    waited_seconds: float

    @property
    def complete(self) -> bool:
        return len(self.present) >= self.wanted

    def message(self) -> str:
        if self.complete:
            return f"{len(self.present)} of {self.wanted} GPUs present after {self.waited_seconds:.1f} s"
        miss = ", ".join(self.missing) if self.missing else "no configured name matches the absent ones"
        return (f"only {len(self.present)} of {self.wanted} GPUs present after {self.waited_seconds:.0f} s "
                f"(found: {', '.join(self.present) or 'none'}; missing: {miss}); applying to the ones present")


async def wait_for_gpus(
    look: Callable[[], Awaitable[tuple[Iterable[str], Iterable[str]]]],
    wanted: int,
    timeout: float,
    interval: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
) -> WaitResult:
    """Call `look()` (→ (present names, configured-but-missing names)) until `wanted` GPUs
    are present or `timeout` passes."""
    start = clock()
    while True:
        present, missing = await look()
        present, missing = tuple(present), tuple(missing)
        elapsed = clock() - start
        if len(present) >= wanted or elapsed >= timeout:
            return WaitResult(wanted, present, missing, elapsed)
        await asyncio.sleep(min(interval, max(0.0, timeout - elapsed)))
