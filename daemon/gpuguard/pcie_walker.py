"""The PCIe walker: re-walks every GPU's PCIe path on its own slower interval (the walk
reads config space and a few dozen attributes per hop) in a worker thread under a
timeout, and keeps the latest report on the hub (the `pcie` view) for /metrics, the API
and the page. The walk's inputs come from the hub as well: which GPUs work now (a slower
link matters only under load), their VRAM size, and the P2P refusal and "Detected VRAM"
lines the kmsg reader classified (they decide a pair's direction and a card's BAR,
INCIDENTS §5); a new one of those starts a walk at once.

What a report means is policy's (policy/pcie_findings.py), handed in: `assess` runs in
the same worker thread right after the walk (it reads sysfs too), `publish` on the loop
with the report and what `assess` returned."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

from gpuguard.hw.pcie import PcieReport, walk
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.pcie")

KERNEL_KINDS = ("p2p_unsupported", "bar_size")
BUSY_RATIO = 0.2  # a slower link is a finding only while the GPU works (ASPM, dynamic PCIe)


class PcieWalker:
    def __init__(
        self,
        hub: Hub,
        root: SysfsRoot,
        interval: float = 60.0,
        timeout: float = 30.0,
        kernel_lines: Callable[[], Iterable[str]] | None = None,
        assess: Callable[[PcieReport], Any] = lambda report: None,
        publish: Callable[[PcieReport, Any], None] = lambda report, assessed: None,
    ) -> None:
        self.hub = hub
        self.root = root
        self.interval = interval
        self.timeout = timeout
        self._kernel_seen: dict[str, str] = {}
        self.kernel_lines = kernel_lines or (lambda: list(self._kernel_seen.values()))
        hub.on_event(self._kernel_event)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.assess = assess
        self.publish = publish

    def _inputs(self) -> tuple[dict[str, bool], dict[str, int]]:
        snap = self.hub.snapshot
        busy, vram = {}, {}
        for g in snap.gpus if snap else ():
            busy[g.bdf] = (g.busy_ratio or 0.0) >= BUSY_RATIO
            if g.vram_total_bytes:
                vram[g.bdf] = g.vram_total_bytes
        return busy, vram

    def _kernel_event(self, ev) -> None:
        if ev.source == "kernel" and ev.kind in KERNEL_KINDS and ev.message not in self._kernel_seen:
            self._kernel_seen[ev.message] = ev.message
            self.walk_soon()

    def walk_soon(self) -> None:
        """Walk now rather than at the next interval: a P2P refusal is that pair's verdict
        when the kernel says it, not a minute later. Safe from any thread."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _walk(self) -> tuple[PcieReport, Any]:
        busy, vram = self._inputs()
        report = walk(self.root, busy, vram=vram, kernel_lines=list(self.kernel_lines()))
        previous = self.hub.view("pcie")
        if report == previous:
            # a walk that found what the last one did keeps that object: /metrics serves its
            # block as rendered (at 32 GPUs re-rendering it took ~40 ms, the scrape's p99)
            report = previous
        return report, self.assess(report)

    async def check_once(self) -> PcieReport | None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            report, assessed = await asyncio.wait_for(loop.run_in_executor(None, self._walk), self.timeout)
        except asyncio.TimeoutError:
            log.error("pcie walk timed out after %ss; keeping the last report", self.timeout)
            return None
        except Exception as e:  # a broken walk must not end the loop
            log.error("pcie walk failed: %s: %s", type(e).__name__, e)
            return None
        self.hub.counters.poll_duration.labels("pcie").observe(loop.time() - t0)
        self.hub.set_view("pcie", report)
        self.publish(report, assessed)
        return report

    async def run(self, stop: asyncio.Event) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not stop.is_set():
            self._wake.clear()
            await self.check_once()
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(waits, timeout=self.interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
