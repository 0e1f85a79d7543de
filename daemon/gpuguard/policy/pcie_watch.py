"""PCIe watch: re-walks every GPU's PCIe path on its own slower interval (the walk reads
config space and a few dozen attributes per hop), keeps the latest report on the hub for
/metrics and the API, and turns doctor findings into events — each finding once when it
appears, so a link that trained at Gen2 at boot (INCIDENTS §4) alerts once, not every
minute, and again if it comes back after having cleared."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Mapping

from gpuguard.hw.pcie import PcieReport, walk
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.doctor import Finding, diagnose, events
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.pcie")

BUSY_RATIO = 0.2  # a slower link is a finding only while the GPU works (ASPM, dynamic PCIe)


class PcieWatch:
    def __init__(
        self,
        hub: Hub,
        root: SysfsRoot,
        expected: Callable[[], Mapping[str, ExpectedLink]] = dict,
        interval: float = 60.0,
        timeout: float = 30.0,
        gpu_names: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.hub = hub
        self.gpu_names = gpu_names  # bdf -> configured name, so events carry `gpu` (issue 21)
        self.root = root
        self.expected = expected
        self.interval = interval
        self.timeout = timeout
        self.active: set[tuple[str, str, str]] = set()  # findings raised and not cleared

    def _inputs(self) -> tuple[dict[str, bool], dict[str, int]]:
        snap = self.hub.snapshot
        busy, vram = {}, {}
        for g in snap.gpus if snap else ():
            busy[g.bdf] = (g.busy_ratio or 0.0) >= BUSY_RATIO
            if g.vram_total_bytes:
                vram[g.bdf] = g.vram_total_bytes
        return busy, vram

    def _check(self) -> tuple[PcieReport, list[Finding]]:
        busy, vram = self._inputs()
        report = walk(self.root, busy, vram=vram)
        return report, diagnose(self.root, report, self.expected())

    async def check_once(self) -> PcieReport | None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            report, findings = await asyncio.wait_for(loop.run_in_executor(None, self._check), self.timeout)
        except asyncio.TimeoutError:
            log.error("pcie walk timed out after %ss; keeping the last report", self.timeout)
            return None
        except Exception as e:  # a broken walk must not end the watch
            log.error("pcie walk failed: %s: %s", type(e).__name__, e)
            return None
        self.hub.counters.poll_duration.labels("pcie").observe(loop.time() - t0)
        self.hub.set_view("pcie", report)
        self.hub.set_view("pcie_findings", tuple(findings))
        now = set()
        for f, ev in zip([f for f in findings if f.level != "OK"], events(findings)):
            key = (f.check, f.where, f.what)
            now.add(key)
            if key not in self.active:
                self.hub.publish(self._named(ev, report))
        self.active = now
        return report

    def _named(self, ev, report: PcieReport):
        """The event with the configured name of its GPU: the finding's address is the GPU's,
        or a hop on the path of one or more GPUs (a shared switch port names them all)."""
        if ev.gpu is not None or ev.bdf is None:
            return ev
        names = self.gpu_names()
        gpus = [names.get(g.bdf, g.bdf) for g in report.gpus
                if g.bdf == ev.bdf or any(h.bdf == ev.bdf for h in g.hops)]
        name = names.get(ev.bdf) or ",".join(sorted(set(gpus))) or None
        return dataclasses.replace(ev, gpu=name) if name else ev

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.check_once()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
