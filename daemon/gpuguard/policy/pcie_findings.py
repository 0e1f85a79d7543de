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
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub


def conditions(findings: Sequence[Finding]) -> dict[tuple, Event]:
    """{key: event} for the walk's WARN and FAIL findings, keyed by check + place. The GPU
    pairs that need the same fix (one `todo`) are one condition: behind a host bridge
    without P2P every pair is a finding (28 at 8 GPUs, 496 at 32), and a warning each
    filled half the event log at every start and held 0.9 MiB (issue 15). doctor and
    /v1/pcie list every pair; the event names the count and one of them."""
    current: dict[tuple, Event] = {}
    pairs: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        if f.level == "OK":
            continue
        if f.check == "pair":
            pairs.setdefault((f.level, f.todo), []).append(f)
        else:
            current[(f.check, f.where)] = events([f])[0]
    for (level, todo), group in pairs.items():
        ev = events(group[:1])[0]
        if len(group) > 1:
            first = group[0]
            ev = dataclasses.replace(
                ev, bdf=None, fields={**ev.fields, "pairs": len(group)},
                message=f"{len(group)} GPU pairs, {first.where} among them (gpuguard doctor lists every pair): "
                        f"{first.what}")
        current[("pair", level, todo)] = ev
    return current


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
        for ev in self.conditions.update(conditions(findings)):
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
