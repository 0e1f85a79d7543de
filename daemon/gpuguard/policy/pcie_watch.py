"""PCIe watch: re-walks every GPU's PCIe path on its own slower interval (the walk reads
config space and a few dozen attributes per hop), keeps the latest report on the hub for
/metrics and the API, and turns doctor findings into conditions (gpuguard.policy.conditions):
a finding keyed by check + place raises once when it starts and once when it clears, so a
link that trained at Gen2 (INCIDENTS §4) alerts once, not at every load cycle. A link seen
slow while its GPU worked is remembered (`seen_under_load`) until it is seen at full speed:
idling in between is the same fault, not a recovery."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Iterable, Mapping

from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_model import PcieReport
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.conditions import Conditions
from gpuguard.policy.doctor import Finding, diagnose, events
from gpuguard.policy.link_history import LinkHistory, boot_time
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.pcie")

KERNEL_KINDS = ("p2p_unsupported", "bar_size")
BUSY_RATIO = 0.2  # a slower link is a finding only while the GPU works (ASPM, dynamic PCIe)


class PcieWatch:
    def __init__(
        self,
        hub: Hub,
        root: SysfsRoot,
        expected: Callable[[], Mapping[str, ExpectedLink]] = dict,
        interval: float = 60.0,
        timeout: float = 30.0,
        kernel_lines: Callable[[], Iterable[str]] | None = None,
        clear_after: int = 2,
        clock: Callable[[], float] = time.time,
        history_path: str | None = None,
        gpu_names: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.hub = hub
        self.gpu_names = gpu_names  # bdf -> configured name, so events carry `gpu`
        self.root = root
        self.expected = expected
        self.interval = interval
        self.timeout = timeout
        # P2P refusal and "Detected VRAM" lines the kmsg reader classified (hub events):
        # they decide a pair's direction and a card's BAR (INCIDENTS §5).
        self._kernel_seen: dict[str, str] = {}
        self.kernel_lines = kernel_lines or (lambda: list(self._kernel_seen.values()))
        hub.on_event(self._kernel_event)
        self.clock = clock
        self.conditions = Conditions(raise_after=1, clear_after=clear_after)
        self.history = LinkHistory(history_path, boot_time(root) if history_path else None)

    def _inputs(self) -> tuple[dict[str, bool], dict[str, int]]:
        snap = self.hub.snapshot
        busy, vram = {}, {}
        for g in snap.gpus if snap else ():
            busy[g.bdf] = (g.busy_ratio or 0.0) >= BUSY_RATIO
            if g.vram_total_bytes:
                vram[g.bdf] = g.vram_total_bytes
        return busy, vram

    def _kernel_event(self, ev) -> None:
        if ev.source == "kernel" and ev.kind in KERNEL_KINDS:
            self._kernel_seen.setdefault(ev.message, ev.message)

    @property
    def seen_under_load(self) -> dict[tuple[str, str, str], tuple[float, float]]:
        return self.history.seen

    def _check(self) -> tuple[PcieReport, list[Finding]]:
        busy, vram = self._inputs()
        report = walk(self.root, busy, vram=vram, kernel_lines=list(self.kernel_lines()))
        self.history.update(report, self.clock())
        return report, diagnose(self.root, report, self.expected(), seen_under_load=dict(self.history.seen))

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
        current = {(f.check, f.where): ev for f, ev in zip([f for f in findings if f.level != "OK"], events(findings))}
        for ev in self.conditions.update(current):
            self.hub.publish(self._named(ev, report))
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
