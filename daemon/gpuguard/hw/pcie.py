"""The PCIe walker, a source: reads every GPU's path from sysfs — each PCI function from
the root bus down to the GPU, its link attributes, config space (port type, link registers,
AtomicOps), AER counters, BARs and VRAM sizes — and builds the immutable `PcieReport`
(gpuguard.hw.pcie_model) that the daemon refreshes on its own slower interval
(gpuguard.pcie_walker). Reads only. The verdicts on what it read (narrowest hop,
downgrade, large BAR) are gpuguard.hw.pcie_verdict; peer-to-peer, gpuguard.hw.pcie_p2p.

A device's bad or missing files never stop the walk: the reason, naming the file, lands in
that hop's or GPU's `errors`, and the value is null, never zero. Only the standard library
is imported here (the capture and `pcie --json` must run on a bare GPU host).
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from itertools import combinations
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from gpuguard.hw import pcie_verdict as verdict
from gpuguard.hw.pci_address import CANONICAL_RE as BDF_RE, ROOT_BUS_RE, addresses_in, host_bridge
from gpuguard.hw.pcie_config import PcieConfig, parse_config
from gpuguard.hw.pcie_model import (
    Bar,
    DpmPcieLevel,
    GpuPair,
    GpuPath,
    HopRole,
    KernelVram,
    LinkKind,
    PcieHop,
    PcieLink,
    PcieReport,
)
from gpuguard.hw.pcie_p2p import Cpu, direction, parse_cpuinfo, path_rule, refusals, summary
from gpuguard.hw.sysfs import SysfsError, SysfsRoot

SPEED_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*GT/s")
DPM_PCIE_RE = re.compile(r"^\s*\d+:\s*([0-9.]+)\s*GT/s,\s*x(\d+)\b.*\*\s*$", re.M)
VRAM_LINE_RE = re.compile(r"Detected VRAM RAM=(\d+)M, BAR=(\d+)M")

GPU_VENDORS = {"1002": "AMD", "10de": "NVIDIA", "8086": "Intel"}
GPU_DRIVERS = {"amdgpu", "nvidia", "nouveau", "radeon", "i915", "xe"}
# INCIDENTS §4: every AMD Navi card hides its GPU behind its own switch pair.
CARD_UPSTREAM_IDS = {("1002", "1478")}
CARD_DOWNSTREAM_IDS = {("1002", "1479")}
DOWNSTREAM_FACING = {"root_port", "switch_downstream", "card_downstream"}
UPSTREAM_FACING = {"switch_upstream", "card_upstream"}
SWITCH_ROLES = {"switch_upstream", "switch_downstream"}
AER_FILES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}


def parse_link_speed(text: str | None) -> float | None:
    """`16.0 GT/s PCIe`, `8 GT/s`, `2.5 GT/s PCIe` -> GT/s; `Unknown`/garbage -> None."""
    if not text:
        return None
    m = SPEED_RE.search(text)
    return float(m.group(1)) if m else None


class _Reader:
    """Reads one PCI function's attributes, recording every failure by attribute name."""

    def __init__(self, root: SysfsRoot, dev_path: str) -> None:
        self.root = root
        self.path = dev_path
        self.errors: dict[str, str] = {}

    def text(self, attr: str, *, optional: bool = False) -> str | None:
        try:
            return self.root.read_text(f"{self.path}/{attr}")
        except SysfsError as e:
            if not (optional and e.errno == errno.ENOENT):
                self.errors[attr] = str(e)
            return None

    def raw(self, attr: str) -> bytes | None:
        try:
            return self.root.read_bytes(f"{self.path}/{attr}")
        except SysfsError as e:
            self.errors[attr] = str(e)
            return None

    def integer(self, attr: str, *, optional: bool = False) -> int | None:
        t = self.text(attr, optional=optional)
        if t is None:
            return None
        try:
            return int(t, 0)
        except ValueError:
            self.errors[attr] = f"{self.path}/{attr}: expected an integer, read {t[:40]!r}"
            return None

    def hexid(self, attr: str) -> str | None:
        t = self.text(attr)
        if t is None:
            return None
        if not re.fullmatch(r"0x[0-9a-fA-F]{1,6}", t):
            self.errors[attr] = f"{self.path}/{attr}: expected a hex id, read {t[:40]!r}"
            return None
        return t[2:].lower().rjust(4, "0") if attr != "class" else "0x" + t[2:].lower().rjust(6, "0")

    def speed(self, attr: str) -> float | None:
        t = self.text(attr, optional=True)
        v = parse_link_speed(t)
        if t is not None and v is None and t.strip() != "Unknown":
            self.errors[attr] = f"{self.path}/{attr}: unreadable speed {t[:40]!r}"
        return v

    def width(self, attr: str) -> int | None:
        v = self.integer(attr, optional=True)
        # The kernel prints 0 when the link is down / the field is not implemented.
        return v or None


@dataclass(frozen=True)
class _Device:
    bdf: str
    path: str
    vendor: str | None
    device: str | None
    class_code: str | None
    driver: str | None
    cur_speed: float | None
    max_speed: float | None
    cur_width: int | None
    max_width: int | None
    config: PcieConfig | None
    aer: Mapping[str, int]
    errors: Mapping[str, str]

    @property
    def is_bridge(self) -> bool:
        return bool(self.class_code and self.class_code.startswith("0x0604"))

    @property
    def is_display(self) -> bool:
        return bool(self.class_code and self.class_code.startswith("0x03"))


def parse_aer(text: str) -> int | None:
    """Total of one `aer_dev_*` file: its TOTAL_ERR_* line, else the sum of the counters."""
    total = None
    sum_ = 0
    seen = False
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            continue
        seen = True
        if parts[0].startswith("TOTAL_ERR_"):
            total = int(parts[1])
        else:
            sum_ += int(parts[1])
    if total is not None:
        return total
    return sum_ if seen else None


def _read_device(root: SysfsRoot, bdf: str, path: str) -> _Device:
    r = _Reader(root, path)
    cfg = None
    data = r.raw("config")
    if data is not None:
        cfg = parse_config(data)
    aer: dict[str, int] = {}
    for sev, fname in AER_FILES.items():
        t = r.text(fname, optional=True)
        if t is not None:
            v = parse_aer(t)
            if v is None:
                r.errors[fname] = f"{path}/{fname}: no 'Name count' lines in {t[:40]!r}"
            else:
                aer[sev] = v
    cur_speed = r.speed("current_link_speed")
    max_speed = r.speed("max_link_speed")
    cur_width = r.width("current_link_width")
    max_width = r.width("max_link_width")
    # Fall back on the config space's own link registers where sysfs says nothing.
    if cfg is not None and cfg.has_pcie:
        cur_speed = cur_speed if cur_speed is not None else cfg.current_speed_gts
        max_speed = max_speed if max_speed is not None else cfg.max_speed_gts
        cur_width = cur_width if cur_width is not None else cfg.current_width
        max_width = max_width if max_width is not None else cfg.max_width
    return _Device(
        bdf=bdf,
        path=path,
        vendor=r.hexid("vendor") or (cfg.vendor if cfg else None),
        device=r.hexid("device") or (cfg.device if cfg else None),
        class_code=r.hexid("class"),
        driver=root.readlink_name(f"{path}/driver"),
        cur_speed=cur_speed,
        max_speed=max_speed,
        cur_width=cur_width,
        max_width=max_width,
        config=cfg,
        aer=aer,
        errors=r.errors,
    )


def _canonical_chain(root: SysfsRoot, bdf: str) -> tuple[str, list[tuple[str, str]]]:
    """(root complex, [(bdf, host-style path)...]) from the root bus down to `bdf`."""
    real = root.realpath(f"/sys/bus/pci/devices/{bdf}")
    parts = real.strip("/").split("/")
    start = 0
    complex_ = "unknown"
    for i, p in enumerate(parts):
        if ROOT_BUS_RE.match(p):
            start, complex_ = i + 1, p
    chain: list[tuple[str, str]] = []
    for i in range(start, len(parts)):
        if BDF_RE.match(parts[i]):
            chain.append((parts[i], "/" + "/".join(parts[: i + 1])))
        else:
            chain = []  # a non-PCI component (VMD domain, ...) restarts the chain below it
    return complex_, chain


def _role(dev: _Device, position: int, parent_role: str | None, is_last: bool) -> tuple[HopRole, bool]:
    ids = (dev.vendor, dev.device)
    cfg = dev.config
    if dev.is_display and is_last:
        return "gpu", not (cfg and cfg.port_type)
    if cfg is not None and cfg.port_type:
        pt = cfg.port_type
        if pt == "switch_upstream" and ids in CARD_UPSTREAM_IDS:
            return "card_upstream", False
        if pt == "switch_downstream" and ids in CARD_DOWNSTREAM_IDS:
            return "card_downstream", False
        if pt in ("root_port", "switch_upstream", "switch_downstream"):
            return pt, False
        if pt in ("endpoint", "legacy_endpoint", "rc_integrated_endpoint"):
            return "endpoint", False
        return "bridge", False
    # Inferred: the config space was not readable (non-root) or has no PCIe capability.
    if ids in CARD_UPSTREAM_IDS:
        return "card_upstream", True
    if ids in CARD_DOWNSTREAM_IDS:
        return "card_downstream", True
    if position == 0 and (dev.is_bridge or not is_last):
        return "root_port", True
    if dev.is_bridge or not is_last:
        if parent_role in DOWNSTREAM_FACING:
            return "switch_upstream", True
        if parent_role in UPSTREAM_FACING:
            return "switch_downstream", True
        return "bridge", True
    if dev.class_code is None and dev.vendor is None:
        return "unknown", True
    return "endpoint", True


def _link(parent: _Device, prole: str, child: _Device, crole: str) -> PcieLink | None:
    if prole in UPSTREAM_FACING:
        return None  # the child sits on the switch's internal bus: no physical link
    if prole not in DOWNSTREAM_FACING and prole not in ("bridge", "unknown"):
        return None
    kind: LinkKind
    if prole == "card_downstream":
        kind = "card_internal"
    elif (
        prole in SWITCH_ROLES
        and crole in SWITCH_ROLES
        and parent.vendor is not None
        and (parent.vendor, parent.device) == (child.vendor, child.device)
    ):
        # INCIDENTS §4: two ports of one switch; their speeds are mirror values.
        kind = "switch_internal"
    else:
        kind = "external"
    # The child's own status is the truth; a switch downstream port may only mirror.
    cur_speed = child.cur_speed if child.cur_speed is not None else parent.cur_speed
    cur_width = child.cur_width if child.cur_width is not None else parent.cur_width
    cap_speed = verdict.capability(parent.max_speed, child.max_speed)
    cap_width = verdict.capability(parent.max_width, child.max_width)
    counts = kind != "switch_internal"
    return PcieLink(
        upper=parent.bdf,
        lower=child.bdf,
        kind=kind,
        current_speed_gts=cur_speed,
        current_width=cur_width,
        capable_speed_gts=cap_speed,
        capable_width=cap_width,
        limited_by=verdict.limited_by(parent.bdf, child.bdf, (parent.max_speed, child.max_speed),
                                      (parent.max_width, child.max_width)),
        downgraded_speed=counts and verdict.downgraded(cur_speed, cap_speed),
        downgraded_width=counts and verdict.downgraded(cur_width, cap_width),
    )


def _root_bus_link(complex_: str, dev: _Device, role: str) -> PcieLink | None:
    """A PCIe device straight on the root bus with no root port above it (a GPU passed
    through into a VM, an integrated function): its own link registers are the only link
    there is, the root complex the other end."""
    if role == "root_port" or (dev.cur_speed is None and dev.cur_width is None):
        return None
    return PcieLink(
        upper=complex_,
        lower=dev.bdf,
        kind="external",
        current_speed_gts=dev.cur_speed,
        current_width=dev.cur_width,
        capable_speed_gts=dev.max_speed,
        capable_width=dev.max_width,
        limited_by=None,
        downgraded_speed=verdict.downgraded(dev.cur_speed, dev.max_speed),
        downgraded_width=verdict.downgraded(dev.cur_width, dev.max_width),
    )


def parse_resource(text: str) -> tuple[Bar, ...]:
    """BARs 0–5 from a `resource` file (`0x%016llx 0x%016llx 0x%016llx` per line)."""
    bars = []
    for index, line in enumerate(text.splitlines()[:6]):
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"resource line {index}: expected 'start end flags', read {line[:60]!r}")
        start, end, flags = (int(p, 16) for p in parts)
        if start == 0 and end == 0:
            continue
        if not flags & 0x200:  # IORESOURCE_MEM; I/O BARs are not VRAM windows
            continue
        bars.append(
            Bar(
                index=index,
                size_bytes=end - start + 1,
                prefetchable=bool(flags & 0x2000),
                is_64bit=bool(flags & 0x100000),
            )
        )
    return tuple(bars)


def parse_dpm_pcie(text: str) -> DpmPcieLevel | None:
    """amdgpu `pp_dpm_pcie`: the active (starred) level's speed and width. RDNA3 may star
    several levels at once (reference/amdgpu/SOURCES.md): take the fastest."""
    levels = [(float(s), int(w)) for s, w in DPM_PCIE_RE.findall(text)]
    return DpmPcieLevel(*max(levels)) if levels else None


def kernel_vram(lines: Iterable[str], gpu_bdfs: list[str]) -> dict[str, KernelVram]:
    """`Detected VRAM RAM=…M, BAR=…M` per GPU. A line without a PCI address is attributed
    only when exactly one AMD GPU exists (the figure is amdgpu's)."""
    found: dict[str, KernelVram] = {}
    for line in lines:
        m = VRAM_LINE_RE.search(line)
        if not m:
            continue
        fig = KernelVram(int(m.group(1)), int(m.group(2)))
        named = addresses_in(line)
        if named and named[0] in gpu_bdfs:
            found[named[0]] = fig
        elif not named and len(gpu_bdfs) == 1:
            found[gpu_bdfs[0]] = fig
    return found


def is_gpu(vendor: str | None, class_code: str | None, driver: str | None) -> bool:
    if not class_code or not class_code.startswith("0x03"):
        return False
    # BMC VGA (ASPEED 1a03, Matrox 102b), virtio-gpu and QEMU VGA are displays, not GPUs.
    return vendor in GPU_VENDORS or driver in GPU_DRIVERS


def _host_bridge(root: SysfsRoot, complex_: str, cache: dict[str, _Device | None]) -> str | None:
    bdf = host_bridge(complex_)
    if bdf is None:
        return None
    dev = cache.get(bdf)
    if dev is None and root.exists(f"/sys/bus/pci/devices/{bdf}"):
        dev = _read_device(root, bdf, root.realpath(f"/sys/bus/pci/devices/{bdf}"))
        cache[bdf] = dev
    if dev is None or not (dev.class_code or "").startswith("0x0600"):
        return None
    return f"{dev.vendor}:{dev.device}"


def _pair(
    a: GpuPath,
    b: GpuPath,
    host_bridges: Mapping[str, str | None],
    cpu: Cpu = Cpu(None, None),
    refused: Mapping[tuple[str, str], str] = MappingProxyType({}),
) -> GpuPair:
    rule = path_rule(a, b, host_bridges, cpu)
    dirs = (direction(a, b, rule, refused), direction(b, a, rule, refused))
    p2p = summary(*dirs)
    if a.root_complex != b.root_complex:
        ids = sorted({h for h in (host_bridges.get(a.root_complex), host_bridges.get(b.root_complex)) if h})
        other_socket = a.numa_node is not None and b.numa_node is not None and a.numa_node != b.numa_node
        return GpuPair(
            a.bdf, b.bdf, "host_bridge", f"{a.root_complex} / {b.root_complex}",
            None, " / ".join(ids) or None, p2p,
            across_root_complexes=True, across_numa_nodes=other_socket, directions=dirs,
        )
    common = None
    for ha, hb in zip(a.hops, b.hops):
        if ha.bdf != hb.bdf:
            break
        common = ha
    hb_ids = host_bridges.get(a.root_complex)
    if common is None:
        return GpuPair(a.bdf, b.bdf, "host_bridge", a.root_complex, hb_ids, hb_ids, p2p, directions=dirs)
    meet = "root_port" if common.role == "root_port" else "switch"
    return GpuPair(a.bdf, b.bdf, meet, common.bdf, common.ids, hb_ids, p2p, directions=dirs)


def read_cpu(root: SysfsRoot) -> Cpu:
    """CPU 0's vendor and family (p2pdma allows host-bridge P2P on AMD Zen and newer)."""
    try:
        return parse_cpuinfo(root.read_text("/proc/cpuinfo"))
    except SysfsError:
        return Cpu(None, None)


def walk(
    root: SysfsRoot,
    busy: Mapping[str, bool] = MappingProxyType({}),
    *,
    kernel_lines: Iterable[str] = (),
    select: Callable[[str, str | None, str | None, str | None], bool] | None = None,
    vram: Mapping[str, int] = MappingProxyType({}),
) -> PcieReport:
    """Walk every GPU's path. `busy[bdf]` says the GPU is working now (a slower link is
    then a real downgrade, not power saving). `kernel_lines` are kernel log lines (for the
    `Detected VRAM` figure). `select(bdf, vendor, class, driver)` replaces the GPU test
    (walk a NIC's path, or a VM's virtio device in tests). Never raises for a device's bad
    or missing files: the reasons land in the hop's / GPU's `errors`. `vram[bdf]` is the
    VRAM size from another source (NVML) for drivers without `mem_info_vram_total`."""
    problems: list[str] = []
    try:
        bdfs = [b for b in root.listdir("/sys/bus/pci/devices") if BDF_RE.match(b)]
    except SysfsError as e:
        return PcieReport((), (), {}, problems=(str(e),))
    cache: dict[str, _Device | None] = {}
    gpus_dev: list[tuple[str, list[tuple[str, str]], str]] = []
    nvswitches = []
    for bdf in bdfs:
        r = _Reader(root, f"/sys/bus/pci/devices/{bdf}")
        cls = r.hexid("class")
        vendor = r.hexid("vendor")
        driver = root.readlink_name(f"/sys/bus/pci/devices/{bdf}/driver")
        if vendor == "10de" and (cls or "").startswith("0x0680"):
            nvswitches.append(bdf)
        if not (select(bdf, vendor, cls, driver) if select else is_gpu(vendor, cls, driver)):
            continue
        complex_, chain = _canonical_chain(root, bdf)
        if not chain or chain[-1][0] != bdf:
            problems.append(f"{bdf}: canonical path {root.realpath('/sys/bus/pci/devices/' + bdf)} has no PCI chain")
            continue
        gpus_dev.append((bdf, chain, complex_))
    kernel_lines = list(kernel_lines)
    vram_lines = kernel_vram(kernel_lines, [b for b, _, _ in gpus_dev])

    paths: list[GpuPath] = []
    for bdf, chain, complex_ in gpus_dev:
        devs = []
        for hop_bdf, path in chain:
            if hop_bdf not in cache or cache[hop_bdf] is None:
                cache[hop_bdf] = _read_device(root, hop_bdf, path)
            devs.append(cache[hop_bdf])
        paths.append(
            _gpu_path(root, bdf, complex_, devs, bool(busy.get(bdf, False)), vram_lines.get(bdf), vram.get(bdf))
        )

    host_bridges = {c: _host_bridge(root, c, cache) for c in sorted({p.root_complex for p in paths})}
    cpu = read_cpu(root) if len(paths) > 1 else Cpu(None, None)
    refused = refusals(kernel_lines)
    pairs = tuple(_pair(a, b, host_bridges, cpu, refused) for a, b in combinations(paths, 2))
    return PcieReport(tuple(paths), pairs, host_bridges, tuple(nvswitches), tuple(problems))


def _gpu_path(
    root: SysfsRoot,
    bdf: str,
    complex_: str,
    devs: list[_Device],
    busy: bool,
    kvram: KernelVram | None,
    vram_other: int | None = None,
) -> GpuPath:
    roles: list[tuple[HopRole, bool]] = []
    for i, d in enumerate(devs):
        roles.append(_role(d, i, roles[-1][0] if roles else None, i == len(devs) - 1))
    links: list[PcieLink | None] = [_root_bus_link(complex_, devs[0], roles[0][0])]
    for i in range(1, len(devs)):
        links.append(_link(devs[i - 1], roles[i - 1][0], devs[i], roles[i][0]))
    # Only a real link can be the bottleneck (switch-internal values mirror another link).
    narrowest = verdict.narrowest([lk.bytes_per_second if lk is not None and lk.counts else None for lk in links])
    slot = verdict.slot_link([lk.kind if lk is not None else None for lk in links])
    hops = []
    for i, d in enumerate(devs):
        below = links[i + 1] if i + 1 < len(links) else None
        down = bool((links[i] and links[i].downgraded) or (below and below.downgraded))
        hops.append(
            PcieHop(
                bdf=d.bdf,
                role=roles[i][0],
                role_inferred=roles[i][1],
                vendor=d.vendor,
                device=d.device,
                class_code=d.class_code,
                driver=d.driver,
                current_speed_gts=d.cur_speed,
                max_speed_gts=d.max_speed,
                current_width=d.cur_width,
                max_width=d.max_width,
                link=links[i],
                downgraded=down,
                narrowest=i == narrowest,
                aer=d.aer,
                config=d.config,
                errors=d.errors,
            )
        )

    gpu = devs[-1]
    r = _Reader(root, gpu.path)
    bars: tuple[Bar, ...] = ()
    res = r.text("resource")
    if res is not None:
        try:
            bars = parse_resource(res)
        except ValueError as e:
            r.errors["resource"] = f"{gpu.path}/resource: {e}"
    vram = r.integer("mem_info_vram_total", optional=True)
    if vram is None:
        vram = vram_other
    vis = r.integer("mem_info_vis_vram_total", optional=True)
    numa = r.integer("numa_node", optional=True)
    dpm_text = r.text("pp_dpm_pcie", optional=True)
    dpm = parse_dpm_pcie(dpm_text) if dpm_text else None

    atomics, note = None, None
    rp = hops[0] if hops and hops[0].role == "root_port" else None
    if rp is None:
        note = (
            "unknown: no root port above the GPU (it sits on the root bus: passed through "
            "into a VM, or integrated); the real root port is not visible here"
        )
    elif rp.config is None:
        note = f"unknown: {rp.errors.get('config', 'config space not readable')}"
    elif rp.config.truncated:
        note = f"unknown (needs root): only {rp.config.size} bytes of {rp.bdf}/config are readable"
    elif rp.config.problem:
        note = f"unknown: {rp.bdf}/config: {rp.config.problem}"
    elif not rp.config.has_pcie:
        note = f"unknown: {rp.bdf} has no PCI Express capability"
    elif rp.config.atomics is None:
        note = f"unknown: {rp.bdf} PCIe capability has no Device Capabilities 2"
    else:
        atomics = rp.config.atomics
    return GpuPath(
        bdf=bdf,
        vendor=gpu.vendor,
        device=gpu.device,
        class_code=gpu.class_code,
        driver=gpu.driver,
        numa_node=numa if numa is not None and numa >= 0 else None,
        busy=busy,
        root_complex=complex_,
        hops=tuple(hops),
        slot_link=slot,
        bars=bars,
        vram_bytes=vram,
        vram_visible_bytes=vis,
        kernel_vram=kvram,
        root_port_atomics=atomics,
        root_port_atomics_note=note,
        dpm_pcie_active=dpm,
        errors=r.errors,
    )
