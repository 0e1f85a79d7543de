"""`gpuguard doctor` findings: every PCIe/BAR/P2P/AtomicOps/AER check over a `PcieReport`,
the expected-link check from config, and the telemetry sanity checks (OD file present on
AMD dGPUs, power cap readable). Each finding is one verdict — OK / WARN / FAIL — with what,
where and what to do. Pure logic over already-read data plus a few presence reads; it
writes nothing (DESIGN.md safety rules: the advice never includes unbind, resize, setpci).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from gpuguard.hw.pci_address import is_canonical, short_bdf
from gpuguard.hw.pcie_model import GpuPath, PcieReport, format_gbps, format_speed
from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.state.events import Event

if TYPE_CHECKING:  # pydantic is needed only with --config; doctor runs without it
    from gpuguard.hw.pcie_expect import ExpectedLink

LEVELS = ("OK", "WARN", "FAIL")
P2P_REFUSED_RE = re.compile(r"P2P access from peer device .* is not supported by the chipset|p2pdma.*not supported", re.I)
AMD_DGPU_MIN_VRAM = 4 << 30


@dataclass(frozen=True)
class Finding:
    level: str  # OK | WARN | FAIL
    check: str  # link, expect_link, bar, atomics, aer, pair, telemetry, host
    what: str
    where: str  # bdf, pair "a ↔ b", or "host"
    todo: str = ""
    gpu_lost: bool = False  # the GPU is lost: this is what its last walk found (policy/pcie_findings.py)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"finding level {self.level!r} not one of {LEVELS}")

    def line(self) -> str:
        tail = f" — {self.todo}" if self.todo else ""
        return f"{self.level:<4} {self.check:<11} {self.where}: {self.what}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "check": self.check, "what": self.what, "where": self.where, "todo": self.todo,
                "gpu_lost": self.gpu_lost}


def exit_status(findings: Iterable[Finding]) -> int:
    """0 all OK, 1 warnings, 2 failures."""
    levels = {f.level for f in findings}
    return 2 if "FAIL" in levels else 1 if "WARN" in levels else 0


def _link_text(speed: float | None, width: int | None) -> str:
    return f"{format_speed(speed)} GT/s x{width if width else '?'}"


LoadHistory = Mapping[tuple[str, str, str], tuple[float, float]]  # (gpu, upper, lower) -> (time, GT/s)


def link_findings(g: GpuPath, seen_under_load: LoadHistory = MappingProxyType({})) -> list[Finding]:
    """A hop is judged by what both ends can and by the GPU's load history: a link seen
    slow while the GPU worked stays "downgraded under load" while it idles (it is the
    same hop, the same fault), until it is seen at full speed again."""
    out: list[Finding] = []
    for h in g.hops:
        lk = h.link
        if lk is None or not lk.counts or not lk.downgraded:
            continue
        where = f"{g.bdf} link {short_bdf(lk.upper)}→{short_bdf(lk.lower)}"
        now = _link_text(lk.current_speed_gts, lk.current_width)
        can = _link_text(lk.capable_speed_gts, lk.capable_width)
        seen = seen_under_load.get((g.bdf, lk.upper, lk.lower))
        if lk.downgraded_width:
            out.append(Finding(
                "FAIL", "link", f"runs {now}, both ends can {can}: lost lanes ({format_gbps(lk.bytes_per_second)})",
                where, "reseat the card and riser, check the slot's lane sharing in the BIOS; a lost lane never comes back by itself",
            ))
        elif g.speed_drop_is_real(lk.current_speed_gts):
            out.append(Finding(
                "FAIL", "link", f"downgraded under load: runs {now}, both ends can {can} "
                f"({format_gbps(lk.bytes_per_second)} of {format_gbps(lk.capable_bytes_per_second)})",
                where, "set the slot's link speed explicitly in the BIOS, check riser/retimer/cable, reseat (INCIDENTS §4)",
            ))
        elif seen is not None:
            at = time.strftime("%H:%M:%S", time.localtime(seen[0]))
            out.append(Finding(
                "FAIL", "link", f"downgraded under load (seen at {at}: {format_speed(seen[1])} GT/s, both ends can {can}); "
                f"idle now at {now}",
                where, "set the slot's link speed explicitly in the BIOS, check riser/retimer/cable, reseat (INCIDENTS §4)",
            ))
        else:
            out.append(Finding(
                "OK", "link", f"power-saving while idle: runs {now} of {can} (ASPM / dynamic PCIe)",
                where, "re-check under load: gpuguard doctor --busy while a job runs",
            ))
    link = g.narrowest_link
    if link is None:
        out.append(Finding("WARN", "link", "link speed unknown: no hop reports its link (no current_link_* attributes)",
                           g.bdf, "a VM or an old kernel; check the host's lspci -vv"))
    else:
        limit = f", limited by {short_bdf(link.limited_by)} ({_role_of(g, link.limited_by)})" if link.limited_by else ""
        out.append(Finding(
            "OK", "narrowest",
            f"{format_gbps(link.bytes_per_second)} at {short_bdf(link.upper)}→{short_bdf(link.lower)} "
            f"({_link_text(link.current_speed_gts, link.current_width)}{limit})",
            g.bdf,
        ))
    return out


def _role_of(g: GpuPath, bdf: str | None) -> str:
    h = next((h for h in g.hops if h.bdf == bdf), None)
    return h.role.replace("_", " ") if h else "?"


def expected_link_findings(
    report: PcieReport, expected: Mapping[str, ExpectedLink], seen_under_load: LoadHistory = MappingProxyType({}),
) -> list[Finding]:
    out: list[Finding] = []
    for bdf, exp in expected.items():
        g = report.gpu(bdf)
        want = _link_text(exp.speed_gts, exp.width).replace("? GT/s ", "").replace(" x?", "")
        if g is None:
            out.append(Finding("FAIL", "expect_link", f"configured GPU not found (expected {want})", bdf,
                               "check the PCI address in the config (lspci -D) and that the card is seated and powered"))
            continue
        slot = g.slot
        if slot is None:
            out.append(Finding("FAIL", "expect_link", f"no slot link readable to compare with {want}", bdf,
                               "run as root on the host itself; a VM hides the link"))
            continue
        where = f"{bdf} slot {short_bdf(slot.upper)}→{short_bdf(slot.lower)}"
        bad = []
        if exp.width and (slot.current_width or 0) < exp.width:
            bad.append(f"x{slot.current_width or '?'} wide")
        if exp.speed_gts and (slot.capable_speed_gts or 0) < exp.speed_gts:
            bad.append(f"capable of only {format_speed(slot.capable_speed_gts)} GT/s")
        elif exp.speed_gts and (slot.current_speed_gts or 0) < exp.speed_gts and g.speed_drop_is_real(slot.current_speed_gts):
            bad.append(f"running {format_speed(slot.current_speed_gts)} GT/s under load")
        elif exp.speed_gts and (seen := seen_under_load.get((g.bdf, slot.upper, slot.lower))) and seen[1] < exp.speed_gts:
            # Idle now, but seen slow under load: the same fault, not a recovery.
            at = time.strftime("%H:%M:%S", time.localtime(seen[0]))
            bad.append(f"running {format_speed(seen[1])} GT/s under load (seen at {at})")
        if bad:
            out.append(Finding("FAIL", "expect_link", f"expected {want}, link is " + ", ".join(bad), where,
                               "move the card to a slot wired for it, or fix the BIOS link setting; then update expect_link"))
        else:
            out.append(Finding("OK", "expect_link", f"matches {want} ({_link_text(slot.current_speed_gts, slot.current_width)} now)", where))
    return out


def bar_findings(g: GpuPath) -> list[Finding]:
    bars = ", ".join(f"BAR{b.index} {_mib(b.size_bytes)}" for b in g.bars) or "no memory BARs readable"
    if g.large_bar is False:
        return [Finding("WARN", "bar", f"{g.large_bar_note} ({bars}): no P2P, slow host copies", g.bdf,
                        "enable Above 4G Decoding and Resizable BAR in the BIOS and reboot (INCIDENTS §5)")]
    return [Finding("OK", "bar", f"{g.large_bar_note} ({bars})", g.bdf)]


def _mib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):g} GiB"
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def atomics_findings(g: GpuPath) -> list[Finding]:
    rp = g.root_port
    where = f"{g.bdf} root port {short_bdf(rp.bdf)}" if rp else g.bdf
    a = g.root_port_atomics
    if a is None:
        note = g.root_port_atomics_note or "unknown"
        todo = ("run gpuguard doctor as root to read the root port's config space" if "needs root" in note
                else "check the root port's AtomicOps on the bare-metal host (lspci -vv: DevCap2 AtomicOpsCap)")
        return [Finding("WARN", "atomics", f"AtomicOps {note}", where, todo)]
    if not a.completes_32_64:
        level = "FAIL" if g.driver == "amdgpu" or g.vendor == "1002" else "WARN"
        return [Finding(level, "atomics", f"root port does not complete 32/64-bit AtomicOps ({a.describe()}): ROCm/HIP refuses kernels",
                        where, "move the GPU to a CPU root port (chipset ports often lack AtomicOps, INCIDENTS §6)")]
    return [Finding("OK", "atomics", f"root port completes AtomicOps ({a.describe()})", where)]


def aer_findings(g: GpuPath) -> list[Finding]:
    out = []
    exported = False
    for h in g.hops:
        if not h.aer:
            continue
        exported = True
        bad = {k: v for k, v in h.aer.items() if v}
        if not bad:
            continue
        level = "FAIL" if bad.get("fatal") or bad.get("nonfatal") else "WARN"
        out.append(Finding(level, "aer", ", ".join(f"{v} {k}" for k, v in bad.items()) + " AER errors",
                           f"{g.bdf} hop {h.bdf}", "watch the trend (gpuguard_pcie_aer_errors_total); rising counts mean a bad slot, riser or card"))
    if not out:
        out.append(Finding("OK", "aer", "no AER errors" if exported else "AER counters not exported by this kernel", g.bdf))
    return out


def pair_findings(report: PcieReport) -> list[Finding]:
    """One verdict per pair from both directions (gpuguard.hw.pcie_p2p: the kernel's
    rules); `OK pair` only when each GPU can reach the other's VRAM."""
    out = []
    for p in report.pairs:
        where = f"{p.a} ↔ {p.b}"
        nvlink = bool(report.nvswitches) and all(
            (report.gpu(x) and report.gpu(x).vendor == "10de") for x in (p.a, p.b)
        )
        if p.p2p != "yes" and nvlink:
            out.append(Finding("OK", "pair", p.verdict + "; NVSwitch present: NVLink carries GPU peer traffic", where))
        elif p.p2p in ("no", "one-way"):
            small = [d.owner for d in p.directions if d.possible is False and d.reason.startswith("small BAR")]
            todo = ("amdgpu lets a peer into a card's VRAM only when its BAR covers all of it: enable Above 4G "
                    "Decoding and Resizable BAR for " + ", ".join(sorted(set(small)))
                    + " in the BIOS and reboot (INCIDENTS §5)") if small else \
                "for tensor parallelism put both GPUs under one switch; otherwise expect host-memory copies"
            out.append(Finding("WARN", "pair", p.verdict, where, todo))
        elif p.p2p == "maybe":
            out.append(Finding("WARN", "pair", f"P2P unknown: {p.verdict}", where,
                               "run gpuguard doctor on the host itself (needs mem_info_* and the host bridge)"))
        else:
            out.append(Finding("OK", "pair", p.verdict, where))
    return out


ASLEEP = ("suspended", "suspending")


def runtime_status(root: SysfsRoot, g: GpuPath) -> str | None:
    """The GPU's `power/runtime_status` (reading it does not wake the card), None when
    unreadable."""
    try:
        return root.read_text(f"/sys/bus/pci/devices/{g.bdf}/power/runtime_status").strip() or None
    except SysfsError:
        return None


def telemetry_findings(root: SysfsRoot, g: GpuPath, asleep: bool = False) -> list[Finding]:
    """`asleep`: the card is runtime-suspended. amdgpu then refuses its power-management
    files (EPERM on 6.14, EBUSY on 7.0) rather than wake it, and gpuguard does not wake a
    sleeping card to read them: that is no telemetry fault (it raised an alert at every walk)."""
    dev = f"/sys/bus/pci/devices/{g.bdf}"
    out = []
    if g.driver == "amdgpu" and asleep:
        out.append(Finding("OK", "telemetry", "OD file pp_od_clk_voltage present" if root.exists(f"{dev}/pp_od_clk_voltage")
                           else "OD file pp_od_clk_voltage not listed while runtime-suspended", g.bdf))
        out.append(Finding("OK", "telemetry", "runtime-suspended: power cap not read (gpuguard does not wake the card); "
                           "checked when it is awake", g.bdf))
    elif g.driver == "amdgpu":
        dgpu = any(h.role == "card_upstream" for h in g.hops) or (g.vram_bytes or 0) >= AMD_DGPU_MIN_VRAM
        if dgpu:
            if root.exists(f"{dev}/pp_od_clk_voltage"):
                out.append(Finding("OK", "telemetry", "OD file pp_od_clk_voltage present", g.bdf))
            else:
                out.append(Finding("FAIL", "telemetry", "OD file pp_od_clk_voltage missing: profiles cannot apply", g.bdf,
                                   "boot with amdgpu.ppfeaturemask=0xfff7ffff (OverDrive bit) and reboot"))
        caps: list = []
        try:
            hwmons = root.listdir(f"{dev}/hwmon")
        except SysfsError as e:
            hwmons, caps = [], [str(e)]
        for hw in hwmons:
            try:
                caps.append(root.read_int(f"{dev}/hwmon/{hw}/power1_cap"))
            except (SysfsError, ValueError) as e:
                caps.append(str(e))
        ok = [c for c in caps if isinstance(c, int) and c > 0]
        if ok:
            out.append(Finding("OK", "telemetry", f"power cap readable: {ok[0] / 1e6:g} W", g.bdf))
        else:
            why = next((c for c in caps if isinstance(c, str)), "no hwmon power1_cap")
            out.append(Finding("FAIL", "telemetry", f"power cap not readable: {why}", g.bdf,
                               "check the amdgpu hwmon node (driver loaded? card in runtime suspend?)"))
    elif g.driver == "nvidia":
        out.append(Finding("OK", "telemetry", "NVIDIA: power cap and clocks come through NVML, not sysfs", g.bdf))
    else:
        out.append(Finding("WARN", "telemetry", f"driver {g.driver or 'none'} bound: no telemetry", g.bdf,
                           "load amdgpu / nvidia for this GPU"))
    return out


def hop_read_findings(g: GpuPath, asleep: bool = False) -> list[Finding]:
    """`asleep`: the GPU is runtime-suspended; its own files refuse reads until it wakes
    (its bridges' do not), which is not a fault of the device."""
    out = []
    for h in g.hops:
        for attr, why in h.errors.items():
            if attr == "config":
                continue  # reported by the AtomicOps check
            out.append(Finding("WARN", "read", f"{attr} unreadable: {why}", f"{g.bdf} hop {h.bdf}",
                               "the value is shown as unknown; a vanished or wedged device reads like this"))
    for attr, why in (() if asleep else g.errors.items()):
        out.append(Finding("WARN", "read", f"{attr} unreadable: {why}", g.bdf))
    return out


def kernel_findings(lines: Iterable[str]) -> list[Finding]:
    refused = [ln.strip() for ln in lines if P2P_REFUSED_RE.search(ln)]
    if refused:
        return [Finding("WARN", "pair", f"kernel refused P2P {len(refused)}×: {refused[-1][:160]}", "host",
                        "the chipset is not on the kernel's p2pdma list; GPUs talk through host memory (INCIDENTS §5)")]
    return []


def diagnose(
    root: SysfsRoot,
    report: PcieReport,
    expected: Mapping[str, ExpectedLink] = MappingProxyType({}),
    kernel_lines: Iterable[str] = (),
    seen_under_load: LoadHistory = MappingProxyType({}),
) -> list[Finding]:
    """Every check, in reading order: host, then each GPU, then pairs, then config.
    `seen_under_load` is the daemon's memory of links seen slow while their GPU worked."""
    out: list[Finding] = []
    for p in report.problems:
        out.append(Finding("WARN", "host", p, "host"))
    if not report.gpus:
        out.append(Finding("WARN", "host", "no GPU found (no PCI display-class device of AMD, NVIDIA or Intel)", "host",
                           "check that the cards are seated and powered and that the driver loaded (lspci -k)"))
    for g in report.gpus:
        out += link_findings(g, seen_under_load)
        out += bar_findings(g)
        out += atomics_findings(g)
        out += aer_findings(g)
        asleep = g.driver == "amdgpu" and runtime_status(root, g) in ASLEEP
        out += telemetry_findings(root, g, asleep)
        out += hop_read_findings(g, asleep)
    out += pair_findings(report)
    out += kernel_findings(list(kernel_lines))
    out += expected_link_findings(report, expected, seen_under_load)
    return out


def events(findings: Iterable[Finding], *, source: str = "pcie") -> list[Event]:
    """Alert-grade events for the hub: FAIL findings are `alert`, WARN `warning`."""
    out = []
    for f in findings:
        if f.level == "OK":
            continue
        first = f.where.split(" ", 1)[0]
        bdf = first if is_canonical(first) else None
        out.append(Event(
            kind=f"pcie_{f.check}", severity="alert" if f.level == "FAIL" else "warning", source=source,
            message=f"{f.where}: {f.what}", bdf=bdf, fields={"todo": f.todo},
        ))
    return out


# ------------------------------------------------------------ config (expect_link)


@dataclass(frozen=True)
class _Identity:
    bdf: str
    vendor: str
    device_id: str


def expected_from_config(entries: Iterable[Any], report: PcieReport) -> dict[str, "ExpectedLink"]:
    """{bdf: expectation} from the config's `gpus[]` (read by gpuguard.config, the daemon's
    own loader), naming GPUs exactly as the daemon does (gpuguard.state.identity). An
    entry that matches no GPU keeps its label (`1002:744c #1`) as key, so the check
    reports it as not found."""
    from gpuguard.state.identity import assign_names

    entries = list(entries)
    names = assign_names([_Identity(g.bdf, g.vendor or "", g.device or "") for g in report.gpus], entries)
    out: dict[str, ExpectedLink] = {}
    for e in entries:
        if e.expect_link is None:
            continue
        hit = [bdf for bdf, name in names.items() if name == e.name]
        label = e.match.bdf or f"{e.match.pci_id} #{e.match.index}"
        out[hit[0] if hit else label] = e.expect_link
    return out
