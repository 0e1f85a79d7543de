"""Peer-to-peer verdicts for a GPU pair, per direction, by the kernel's own rules: can
GPU A read and write GPU B's VRAM over PCIe? Pure logic over an already walked path.

The rules (INCIDENTS §5; checked against the kernel sources, not guessed):
- amdgpu (`amdgpu_device_is_peer_accessible(adev, peer)` in
  drivers/gpu/drm/amd/amdgpu/amdgpu_device.c) lets a peer into a device's VRAM only when
  that device's BAR exposes all of it (`visible_vram_size == real_vram_size`, sysfs
  `mem_info_vis_vram_total == mem_info_vram_total`) and `pci_p2pdma_distance()` allows
  the path. The BAR that matters is the one of the card being accessed, so one large
  and one small BAR is one-way at best. When the path is refused it logs, on the
  accessed device, "PCIe P2P access from peer device <peer> is not supported by the
  chipset".
- drivers/pci/p2pdma.c (`calc_map_type_and_dist`): two devices under a common upstream
  bridge (a switch, or the same root port) talk on the bus. Without one, traffic goes
  through the host bridge, allowed only on an AMD Zen or newer CPU (family >= 0x17,
  `cpu_supports_p2pdma`) or when the host bridge (the device at 00.0 of the root bus)
  is on `pci_p2pdma_whitelist`: within one host bridge any entry, across two host
  bridges only entries without REQ_SAME_HOST_BRIDGE. ACS redirect on a port of a common
  path also sends traffic through the host bridge; gpuguard does not read ACS control,
  so a kernel refusal line is the final word there.
Other drivers (NVIDIA) map peers through their own BAR1 logic and judge host-bridge paths
themselves (`nvidia-smi topo -p2p r`): for them a host-bridge path the kernel list refuses
is "unknown", not "no".
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterable, Mapping

from gpuguard.hw.pci_address import BDF_PATTERN
from gpuguard.hw.pcie_verdict import size_text

if TYPE_CHECKING:
    from gpuguard.hw.pcie_model import GpuPath

# drivers/pci/p2pdma.c pci_p2pdma_whitelist: vendor:device -> needs the same host bridge.
P2PDMA_WHITELIST = {
    "8086:3c00": True, "8086:3c01": True,  # Xeon E5 / Core i7
    "8086:2f00": True, "8086:2f01": True,  # Xeon E7 v3 / E5 v3 / Core i7
    "8086:2030": False, "8086:2031": False, "8086:2032": False, "8086:2033": False,  # Skylake-E
    "8086:2020": False, "8086:09a2": False,
}
AMD_ZEN_FAMILY = 0x17
REFUSED_AMDGPU_RE = re.compile(
    rf"\b({BDF_PATTERN})\b.*P2P access from peer device ({BDF_PATTERN}) is not supported", re.I)
REFUSED_P2PDMA_RE = re.compile(
    rf"\b({BDF_PATTERN})\b.*cannot be used for peer-to-peer DMA as the client and provider \(({BDF_PATTERN})\)", re.I)


@dataclass(frozen=True)
class Cpu:
    """What p2pdma asks of the CPU: vendor and family of CPU 0 (from /proc/cpuinfo)."""

    vendor: str | None  # "AuthenticAMD", "GenuineIntel", None: unknown
    family: int | None

    @property
    def supports_p2pdma(self) -> bool:
        return self.vendor == "AuthenticAMD" and (self.family or 0) >= AMD_ZEN_FAMILY


def parse_cpuinfo(text: str) -> Cpu:
    vendor = family = None
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "vendor_id" and vendor is None:
            vendor = val
        elif key == "cpu family" and family is None and val.isdigit():
            family = int(val)
        elif not line.strip() and vendor is not None:
            break  # CPU 0 only, as the kernel asks cpu_data(0)
    return Cpu(vendor, family)


def refusals(lines: Iterable[str]) -> dict[tuple[str, str], str]:
    """{(reader, owner): line} for every kernel line refusing `reader` access to `owner`."""
    out: dict[tuple[str, str], str] = {}
    for line in lines:
        m = REFUSED_AMDGPU_RE.search(line)
        if m:  # logged on the accessed device, naming the peer
            out[(m.group(2).lower(), m.group(1).lower())] = line.strip()
            continue
        m = REFUSED_P2PDMA_RE.search(line)
        if m:  # logged on the client, naming the provider
            out[(m.group(1).lower(), m.group(2).lower())] = line.strip()
    return out


@dataclass(frozen=True)
class PeerDirection:
    """Whether `reader` can access `owner`'s VRAM peer-to-peer, and why."""

    reader: str
    owner: str
    possible: bool | None  # None: this host does not say
    reason: str

    DOCUMENT: ClassVar = (("from", "reader"), ("to", "owner"), "possible", "reason")


@dataclass(frozen=True)
class PathRule:
    allowed: bool | None
    reason: str
    via_host_bridge: bool = True


def path_rule(a: "GpuPath", b: "GpuPath", host_bridges: Mapping[str, str | None], cpu: Cpu) -> PathRule:
    """p2pdma's path check (symmetric but for ACS): common upstream bridge, else the host
    bridge allowed by the CPU or the whitelist."""
    if a.root_complex == b.root_complex:
        common = None
        for ha, hb in zip(a.hops, b.hops):
            if ha.bdf != hb.bdf:
                break
            common = ha
        if common is not None:
            what = "root port" if common.role == "root_port" else "switch"
            return PathRule(True, f"common upstream bridge: {what} {common.bdf} ({common.ids})", False)
    hb_a, hb_b = host_bridges.get(a.root_complex), host_bridges.get(b.root_complex)
    same = a.root_complex == b.root_complex
    where = f"host bridge {hb_a or '?'}" if same else f"host bridges {hb_a or '?'} / {hb_b or '?'} ({a.root_complex} / {b.root_complex})"
    sockets = (" on different CPU sockets" if a.numa_node is not None and b.numa_node is not None
               and a.numa_node != b.numa_node else "")
    if cpu.supports_p2pdma:
        return PathRule(True, f"through {where}{sockets}: AMD Zen or newer CPU (family {cpu.family:#x}) allows it")
    ids = [hb_a] if same else [hb_a, hb_b]
    if all(i in P2PDMA_WHITELIST and (same or not P2PDMA_WHITELIST[i]) for i in ids):
        return PathRule(True, f"through {where}{sockets}: on the kernel's p2pdma host-bridge list")
    if cpu.vendor is None and any(i and i.startswith("1022:") for i in ids):
        return PathRule(None, f"through {where}: allowed only on an AMD Zen or newer CPU; /proc/cpuinfo not readable")
    if any(i is None for i in ids):
        return PathRule(None, f"through {where}: host bridge id unknown, the kernel's p2pdma list cannot be checked")
    why = ("listed only for peers under one host bridge" if not same and any(i in P2PDMA_WHITELIST for i in ids)
           else "not on the kernel's p2pdma host-bridge list")
    return PathRule(False, f"through {where}{sockets}: {why}: chipset refuses P2P")


def _is_amd(g: "GpuPath") -> bool:
    return g.driver == "amdgpu" or (g.driver is None and g.vendor == "1002")


def _bar_rule(owner: "GpuPath") -> tuple[bool | None, str]:
    if not _is_amd(owner):
        return True, ""
    lb = owner.large_bar
    if lb is True:
        return True, f"{owner.bdf} BAR covers all its VRAM"
    if lb is None:
        return None, f"{owner.bdf}: {owner.large_bar_note}"
    if owner.vram_bytes and owner.vram_visible_bytes is not None:
        seen = f"{size_text(owner.vram_visible_bytes)} of {size_text(owner.vram_bytes)}"
    else:
        seen = owner.large_bar_note
    # amdgpu_device_is_peer_accessible: peers only into a device whose BAR covers all VRAM.
    return False, f"small BAR on {owner.bdf}: the CPU sees {seen} VRAM, amdgpu needs all of it for P2P"


def direction(reader: "GpuPath", owner: "GpuPath", path: PathRule,
              refused: Mapping[tuple[str, str], str]) -> PeerDirection:
    line = refused.get((reader.bdf, owner.bdf))
    if line:
        return PeerDirection(reader.bdf, owner.bdf, False, f"kernel refused it: {line[:200]}")
    bar_ok, bar_why = _bar_rule(owner)
    if bar_ok is False:
        return PeerDirection(reader.bdf, owner.bdf, False, bar_why)
    if path.allowed is False and path.via_host_bridge and not (_is_amd(owner) and _is_amd(reader)):
        return PeerDirection(reader.bdf, owner.bdf, None,
                             f"{path.reason} for amdgpu; the NVIDIA driver decides host-bridge P2P itself "
                             "(nvidia-smi topo -p2p r)")
    if path.allowed is False:
        return PeerDirection(reader.bdf, owner.bdf, False, path.reason)
    if bar_ok is None or path.allowed is None:
        why = "; ".join(w for ok, w in ((bar_ok, bar_why), (path.allowed, path.reason)) if ok is None)
        return PeerDirection(reader.bdf, owner.bdf, None, why)
    return PeerDirection(reader.bdf, owner.bdf, True, "; ".join(w for w in (path.reason, bar_why) if w))


def summary(ab: PeerDirection, ba: PeerDirection) -> str:
    """yes only when both directions are possible; one-way when exactly one is."""
    if ab.possible and ba.possible:
        return "yes"
    if ab.possible is False and ba.possible is False:
        return "no"
    if ab.possible and ba.possible is False or ba.possible and ab.possible is False:
        return "one-way"
    return "maybe"
