"""What the daemon does when the kernel speaks: the real implementations of the kernel
router's hooks (gpuguard.kernel.router.ActionHook). The router decides *when* (policy per
kind, debounce); this module decides *what*:

- a GPU lost (device lost, reset failed with -19, udev remove) was marked lost in the GPU
  state by the router: nothing writes to it until it is back (DESIGN safety rule); here
  the poller is asked to look again;
- gpu_hang / sq_interrupt / device_lost: the engines on that GPU are killed at once
  (INCIDENTS §1: both GPUs were off the bus within a minute of the stall);
- after gpu_reset_ok the card is at stock settings and every context on it is dead
  (`VRAM is lost`): the state owner made its profile pending again (the profile runtime
  re-applies it) and here its engines are restarted.
Other modules register their handlers here (`on_fatal`, `on_reset_ok`, `on_lost`).
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuStates

log = logging.getLogger("gpuguard.kernel")

Handler = Callable[..., Any]


class KernelActions:
    def __init__(self, gpus: GpuStates, request_discovery: Callable[[], None] = lambda: None) -> None:
        self.gpus = gpus
        self.request_discovery = request_discovery
        self.on_fatal: list[Handler] = []  # (gpu_name | None, bdf | None, kind)
        self.on_reset_ok: list[Handler] = []  # (gpu_name, bdf)
        self.on_lost: list[Handler] = []  # (gpu_name, bdf)

    def _name(self, bdf: str | None) -> str | None:
        return self.gpus.name(bdf) if bdf else None

    async def _run(self, handlers: list[Handler], *args: Any) -> None:
        for h in handlers:
            try:
                r = h(*args)
                if inspect.isawaitable(r):
                    await r
            except Exception as e:  # one broken handler must not stop the others
                log.error("kernel action handler %s failed: %s: %s", getattr(h, "__qualname__", h), type(e).__name__, e)

    # -- ActionHook ---------------------------------------------------------------------
    def on_alert(self, event: Event) -> None:
        pass  # every event already reaches the hub (webhooks, recorder, log)

    async def on_gpu_lost(self, bdf: str) -> None:
        self.request_discovery()
        await self._run(self.on_lost, self._name(bdf), bdf)

    async def on_gpu_fatal(self, bdf: str | None, kind: str) -> None:
        await self._run(self.on_fatal, self._name(bdf), bdf, kind)

    async def on_gpu_reset_ok(self, bdf: str) -> None:
        await self._run(self.on_reset_ok, self._name(bdf), bdf)

    def on_gpu_appeared(self, bdf: str) -> None:
        self.request_discovery()
