"""What each PCIe walk means: doctor's findings (policy/doctor.py) on the report, kept on
the hub (the `pcie_findings` view) and turned into conditions (state/conditions.py): a
finding keyed by check + place raises once when it starts and once when it clears, so a
link that trained at Gen2 (INCIDENTS §4) alerts once, not at every load cycle. A link seen
slow while its GPU worked is remembered (`seen_under_load`, policy/link_history.py, kept
across restarts) until it is seen at full speed: idling in between is the same fault, not
a recovery.

The walker (gpuguard/pcie_walker.py) calls `assess` in its worker thread after each walk
and `publish` on the loop."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

from gpuguard.hw.pcie import PcieReport
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.doctor import Finding, diagnose, events
from gpuguard.policy.link_history import LinkHistory, boot_time
from gpuguard.state.conditions import Conditions
from gpuguard.state.hub import Hub


class PcieFindings:
    def __init__(
        self,
        hub: Hub,
        root: SysfsRoot,
        expected: Callable[[], Mapping[str, ExpectedLink]] = dict,
        clear_after: int = 2,
        clock: Callable[[], float] = time.time,
        history_path: str | None = None,
        gpu_names: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.hub = hub
        self.root = root
        self.expected = expected
        self.clock = clock
        self.gpu_names = gpu_names  # bdf -> configured name, so events carry `gpu`
        self.conditions = Conditions(raise_after=1, clear_after=clear_after)
        self.history = LinkHistory(history_path, boot_time(root) if history_path else None)

    @property
    def seen_under_load(self) -> dict[tuple[str, str, str], tuple[float, float]]:
        return self.history.seen

    def assess(self, report: PcieReport) -> list[Finding]:
        """The findings on `report` (reads sysfs: runs in the walker's thread)."""
        self.history.update(report, self.clock())
        return diagnose(self.root, report, self.expected(), seen_under_load=dict(self.history.seen))

    def publish(self, report: PcieReport, findings: Sequence[Finding]) -> None:
        self.hub.set_view("pcie_findings", tuple(findings))
        current = {(f.check, f.where): ev for f, ev in zip([f for f in findings if f.level != "OK"], events(findings))}
        for ev in self.conditions.update(current):
            self.hub.publish(self._named(ev, report))

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
