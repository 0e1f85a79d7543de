"""What each PCIe walk means: doctor's findings (policy/doctor.py) on the report, kept on
the hub (the `pcie_findings` view) and turned into conditions (state/conditions.py): a
finding keyed by check + place raises once when it starts and once when it clears, so a
link that trained at Gen2 (INCIDENTS §4) alerts once, not at every load cycle. A link seen
slow while its GPU worked is remembered (`seen_under_load`, policy/link_history.py, kept
across restarts) until it is seen at full speed: idling in between is the same fault, not
a recovery.

A GPU that is lost (fallen off the bus, declared lost by the kernel, not answering) keeps
the findings and the PCIe series of its last walk before the loss, marked "GPU lost", until
it is back and walked again: its files vanishing is not its slot being fixed (a lost card's
Gen2 alert resolved ten seconds after `sim lose`). Only what that walk shows fixed clears.

The walker (gpuguard/pcie_walker.py) calls `assess` in its worker thread after each walk
and `publish` on the loop."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

from gpuguard.hw.pcie import PcieReport
from gpuguard.hw.pcie_model import GpuPair, GpuPath
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.doctor import Finding, diagnose, events
from gpuguard.pcie_walker import KERNEL_KINDS
from gpuguard.policy.link_history import KernelLines, LinkHistory, boot_time
from gpuguard.state.conditions import Conditions
from gpuguard.state.events import Event
from gpuguard.state.gpus import PRESENT
from gpuguard.state.hub import Hub


def gpus_of(f: Finding) -> tuple[str, ...]:
    """The GPUs a finding is about: the one it is placed at or on the path of (`<bdf> link
    …`), the two of a pair; a host finding names none."""
    if f.check == "pair":
        return tuple(f.where.split(" ↔ "))
    return (f.where.split(" ", 1)[0],)


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


_Walked = tuple[GpuPath, tuple[GpuPair, ...], tuple[Finding, ...]]  # one GPU's path, pairs, findings


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
        kernel_path: str | None = None,
    ) -> None:
        self.hub = hub
        self.root = root
        self.expected = expected
        self.clock = clock
        self.gpu_names = gpu_names  # bdf -> configured name, so events carry `gpu`
        self.conditions = Conditions(raise_after=1, clear_after=clear_after)
        self.history = LinkHistory(history_path, boot_time(root) if history_path else None)
        # the kernel's P2P refusals and BAR figures the daemon read (the walker's input):
        # kept across restarts, for doctor too (policy/link_history.py)
        self.kernel = KernelLines(kernel_path, boot_time(root) if kernel_path else None)
        hub.on_event(self._kernel_event)
        # each GPU's last walk while present: what a lost GPU keeps
        # (the one kept, the newest)
        self._walks: dict[str, tuple[_Walked, _Walked]] = {}
        self._reported_from: tuple = ()
        self._lost_at: dict[str, float] = {}
        self.held: frozenset[str] = frozenset()  # GPUs reported from their last walk (lost)
        self.reported: PcieReport | None = None  # the walk plus the held GPUs (for /metrics)

    @property
    def seen_under_load(self) -> dict[tuple[str, str, str], tuple[float, float]]:
        return self.history.seen

    def _kernel_event(self, ev: Event) -> None:
        if ev.source == "kernel" and ev.kind in KERNEL_KINDS:
            self.kernel.add(ev.message, ev.time)

    def kernel_lines(self) -> list[str]:
        """The walk's kernel lines (PcieWalker's `kernel_lines`)."""
        return self.kernel.lines()

    def assess(self, report: PcieReport) -> list[Finding]:
        """The findings on `report` (reads sysfs: runs in the walker's thread)."""
        self.kernel.flush()
        self.history.update(report, self.clock())
        return diagnose(self.root, report, self.expected(), seen_under_load=dict(self.history.seen))

    def publish(self, report: PcieReport, findings: Sequence[Finding]) -> None:
        findings = self._hold_lost(report, list(findings))
        self.hub.set_view("pcie_findings", tuple(findings))
        for ev in self.conditions.update(conditions(findings)):
            self.hub.publish(self._named(ev, report))

    def _gone(self, report: PcieReport) -> set[str]:
        """GPUs walked before that are lost now: the state owner says so (lost, not
        answering, off the bus), or, where no poller reports into it, the walk no longer
        finds them. A GPU the state owner has forgotten (identified at another address) is
        history, not lost."""
        states = self.hub.gpus
        gone = set()
        for bdf in self._walks:
            s = states.get(bdf)
            if s is not None:
                if s.presence != PRESENT or not s.on_bus:
                    gone.add(bdf)
            elif not states.observed and report.gpu(bdf) is None:
                gone.add(bdf)
        return gone

    def _hold_lost(self, report: PcieReport, findings: list[Finding]) -> list[Finding]:
        """The findings with each lost GPU's replaced by those of its last walk, marked;
        records the walk of every GPU present now. Runs on the loop (reads GPU state)."""
        gone = self._gone(report)
        for bdf in list(self._walks):
            if bdf not in gone and report.gpu(bdf) is None:
                del self._walks[bdf]  # history (moved away): nothing to keep
        # grouped once: at 32 GPUs a walk has ~750 findings, 496 of them pairs
        by_gpu: dict[str, list[Finding]] = {}
        for f in findings:
            if not gone.intersection(gpus_of(f)):
                for b in gpus_of(f):
                    by_gpu.setdefault(b, []).append(f)
        pairs_of: dict[str, list[GpuPair]] = {}
        for p in report.pairs:
            if p.a not in gone and p.b not in gone:
                pairs_of.setdefault(p.a, []).append(p)
                pairs_of.setdefault(p.b, []).append(p)
        for g in report.gpus:
            if g.bdf not in gone:
                pairs, mine = tuple(pairs_of.get(g.bdf, ())), tuple(by_gpu.get(g.bdf, ()))
                # the walk before the newest is the one kept: the newest may have caught the
                # card falling off the bus before the poller said so (all-ones config space)
                self._walks[g.bdf] = (self._walks.get(g.bdf, (None, None))[1] or (g, pairs, mine), (g, pairs, mine))
                self._lost_at.pop(g.bdf, None)
        held = frozenset(b for b in gone if b in self._walks)
        if not held:
            self.held, self.reported = frozenset(), report
            return findings
        out = [f for f in findings if not held.intersection(gpus_of(f))]
        seen = {(f.check, f.where) for f in out}
        paths: dict[str, GpuPath] = {}
        pairs: dict[frozenset[str], GpuPair] = {}
        for bdf in sorted(held):
            at = time.strftime("%H:%M:%S", time.localtime(self._lost_at.setdefault(bdf, self.clock())))
            path, its_pairs, its = self._walks[bdf][0]
            paths[bdf] = path
            for p in its_pairs:
                pairs.setdefault(frozenset((p.a, p.b)), p)
            for f in its:
                if (f.check, f.where) not in seen:
                    seen.add((f.check, f.where))
                    out.append(dataclasses.replace(f, what=f"GPU lost since {at}, as last walked: {f.what}", gpu_lost=True))
        if not self._reported_from or self._reported_from[0] is not report or self._reported_from[1] != held:
            # a new object only when the walk or the held set changed: /metrics keeps its block
            self._reported_from = (report, held)
            # a held GPU still in the walk (reads failing, not yet off the bus) shows its kept path
            walked = {g.bdf for g in report.gpus}
            gpus = tuple(paths.get(g.bdf, g) for g in report.gpus) + tuple(p for b, p in paths.items() if b not in walked)
            now = {frozenset((p.a, p.b)) for p in report.pairs}
            self.reported = dataclasses.replace(
                report, gpus=gpus, pairs=tuple(pairs.get(frozenset((p.a, p.b)), p) for p in report.pairs)
                + tuple(p for k, p in pairs.items() if k not in now))
        self.held = held
        return out

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
