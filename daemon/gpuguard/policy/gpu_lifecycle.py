"""What happens to the engines when a GPU is lost or comes back, whatever the route
(gone from the bus, not answering past `poll.lost_after_seconds`, a kernel line, a udev
remove): one policy for all of them (only a kernel line used to kill).

- lost: the engines on that GPU are killed at once (INCIDENTS §1: both GPUs were off the
  bus within a minute of the stall; an engine on a dead GPU only hangs its clients). The
  state owner already stopped every write to it and raised the `gpu_lost` alert.
- back, or reset while present: the card is at stock settings (the profile runtime
  re-applies its profile, the state owner made it pending) and every context on it is
  dead: its engines are restarted.

A loss reported by several routes (a kernel line, then the bus) kills once per
`debounce_s`: the kernel router's own kill and this one share `kill_engines`.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Awaitable, Callable

from gpuguard.state.gpus import GpuState, GpuStates

log = logging.getLogger("gpuguard.lifecycle")

Kill = Callable[[str, str, dict], Awaitable[Any] | Any]  # (gpu name, reason, evidence)
Restart = Callable[[str, str], Awaitable[Any] | Any]  # (gpu name, reason)


class GpuLifecycle:
    def __init__(self, gpus: GpuStates, kill: Kill | None = None, restart: Restart | None = None,
                 debounce_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.gpus = gpus
        self.kill = kill
        self.restart = restart
        self.debounce_s = debounce_s
        self.clock = clock
        self._last_kill: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        gpus.on_lost.append(self._on_lost)
        gpus.on_back.append(self._on_back)
        gpus.on_reset.append(self._on_reset)

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.error("gpu lifecycle: no event loop to run %s%r on", getattr(fn, "__name__", fn), args)
            return
        t = loop.create_task(fn(*args))  # type: ignore[arg-type]
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _on_lost(self, s: GpuState, by: str) -> None:
        self._spawn(self.kill_engines, s.name, "gpu_lost", {"bdf": s.bdf, "route": by})

    def _on_back(self, s: GpuState, how: str) -> None:
        self._last_kill.pop(s.name, None)
        if self.restart is None or not self.gpus.engines_on(s.bdf):
            return
        self._spawn(self._call, self.restart, s.name, "gpu_back")

    def _on_reset(self, s: GpuState, why: str) -> None:
        # after `GPU reset succeeded` every context on the card is dead (`VRAM is lost`)
        if self.restart is not None and self.gpus.engines_on(s.bdf):
            self._spawn(self._call, self.restart, s.name, "gpu_reset_ok")

    async def kill_engines(self, gpu: str, reason: str, evidence: dict | None = None) -> bool:
        """Kill the engines on `gpu` unless they were killed for it within debounce_s."""
        if self.kill is None:
            return False
        now = self.clock()
        last = self._last_kill.get(gpu)
        if last is not None and now - last < self.debounce_s:
            log.info("engines on %s already killed %.1f s ago (%s): not again", gpu, now - last, reason)
            return False
        self._last_kill[gpu] = now
        await self._call(self.kill, gpu, reason, dict(evidence or {}))
        return True

    @staticmethod
    async def _call(fn: Callable[..., Any], *args: Any) -> None:
        try:
            r = fn(*args)
            if inspect.isawaitable(r):
                await r
        except Exception as e:  # the policy must survive a failing kill
            log.error("gpu lifecycle action %s%r failed: %s: %s", getattr(fn, "__qualname__", fn), args, type(e).__name__, e)

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
