"""The PCIe path of every GPU: each device from its root port down to the GPU function,
the links between them, the narrowest hop (the GPU's real bandwidth ceiling), BARs and
large-BAR state, where GPU pairs meet (switch / root port / host bridge), the root port's
AtomicOp completer support and AER counters. Reads only; `walk()` returns an immutable
`PcieReport` the poller refreshes on its own slower interval.

Model. A *hop* is one PCI function on the GPU's canonical sysfs path
(`/sys/devices/pci0000:a0/0000:a0:02.0/.../0000:aa:00.0`). A *link* joins a
downstream-facing port (root port, switch downstream port, the card's own downstream
bridge) to its child; it is stored on the child hop as `link`. A child of an
upstream-facing port (a switch's downstream ports) sits on that switch's internal bus and
has no link above it (`link is None`). A GPU straight on the root bus (passed through into
a VM: the H200 test host has its GPU at 0000:00:06.0) has its own link, `upper` being the
root complex name. Link kinds:
  external         a real link (root port link, slot link, board link)
  card_internal    below an AMD card's own bridge pair (1002:1479 → GPU): reports the
                   card's internal Gen4/Gen5, not the slot (INCIDENTS §4)
  switch_internal  between two ports of the same switch (same vendor:device both ends):
                   mirror values, never blamed as narrowest or downgraded (INCIDENTS §4)

JSON schema (`PcieReport.to_dict()`, `gpuguard pcie --json`), version 1:
  {"schema": 1,
   "gpus": [{"bdf", "vendor", "device", "class", "driver", "numa_node", "busy",
             "root_complex", "root_port", "slot_link": hop index|null,
             "narrowest": {"hop": index, "upper": bdf, "lower": bdf,
                           "bytes_per_second", "limited_by": bdf|null}|null,
             "hops": [{"bdf", "role", "role_inferred", "vendor", "device", "class",
                       "driver", "current_speed_gts", "max_speed_gts", "current_width",
                       "max_width", "downgraded", "narrowest",
                       "link": {"upper", "lower", "kind", "current_speed_gts",
                                "current_width", "capable_speed_gts", "capable_width",
                                "limited_by", "downgraded_speed", "downgraded_width",
                                "bytes_per_second", "capable_bytes_per_second"}|null,
                       "aer": {"correctable"|"nonfatal"|"fatal": total},
                       "errors": {attribute: reason}}],
             "bars": [{"index", "size_bytes", "prefetchable", "is_64bit"}],
             "vram_bytes", "vram_visible_bytes", "large_bar": true|false|null,
             "large_bar_note", "kernel_vram": {"ram_mib", "bar_mib"}|null,
             "root_port_atomics": {"routing", "completer32", "completer64",
                                   "completer128_cas"}|null,
             "root_port_atomics_note": str|null,
             "dpm_pcie_active": {"speed_gts", "width"}|null,
             "errors": {attribute: reason}}],
   "pairs": [{"a", "b", "meet": "switch"|"root_port"|"host_bridge",
              "at": bdf | "pci0000:00" | "pci0000:00 / pci0000:a0", "at_ids": "vvvv:dddd"|null,
              "host_bridge": "vvvv:dddd"|null, "p2p": "yes"|"no"|"one-way"|"maybe",
              "directions": [{"from": bdf, "to": bdf, "possible": bool|null, "reason": str}] (a→b, b→a),
              "across_root_complexes": bool, "across_numa_nodes": bool, "verdict": str}],
   "host_bridges": {"pci0000:00": "8086:6f00"|null},
   "nvswitches": [bdf], "problems": [str]}
Only the standard library is imported here (the capture and `pcie --json` must run on a
bare GPU host); the config schema is in gpuguard.hw.pcie_expect.
Speeds are GT/s per lane, bandwidths bytes per second per direction; null means the
value could not be read (the reason is in that hop's `errors`), never zero.
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from itertools import combinations
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

from gpuguard.hw.pci_address import CANONICAL_RE as BDF_RE, ROOT_BUS_RE, addresses_in, host_bridge, short_bdf
from gpuguard.hw.pcie_config import AtomicOps, PcieConfig, parse_config
from gpuguard.hw.pcie_p2p import Cpu, PeerDirection, direction, parse_cpuinfo, path_rule, refusals, summary
from gpuguard.hw.sysfs import SysfsError, SysfsRoot

SCHEMA_VERSION = 1
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
AER_TOTALS = {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL", "fatal": "TOTAL_ERR_FATAL"}


def _frozen(m: Mapping | None) -> Mapping:
    return MappingProxyType(dict(m or {}))


# ---------------------------------------------------------------- link arithmetic


def parse_link_speed(text: str | None) -> float | None:
    """`16.0 GT/s PCIe`, `8 GT/s`, `2.5 GT/s PCIe` -> GT/s; `Unknown`/garbage -> None."""
    if not text:
        return None
    m = SPEED_RE.search(text)
    return float(m.group(1)) if m else None


def encoding_efficiency(gts: float) -> float:
    """Payload share of the line rate: 8b/10b up to 5 GT/s, 128b/130b from 8 GT/s,
    242B/256B FLIT at 64 GT/s."""
    if gts <= 5.0:
        return 8 / 10
    if gts < 64.0:
        return 128 / 130
    return 242 / 256


def link_bytes_per_second(gts: float | None, width: int | None) -> float | None:
    """Usable bandwidth of a link per direction, bytes/s; None when a figure is unknown."""
    if not gts or not width:
        return None
    return gts * 1e9 * encoding_efficiency(gts) * width / 8


def format_speed(gts: float | None) -> str:
    return "?" if gts is None else f"{gts:.1f}"


def format_gbps(bps: float | None) -> str:
    return "?" if bps is None else f"{bps / 1e9:.2f} GB/s"


# ---------------------------------------------------------------- result types


@dataclass(frozen=True)
class PcieLink:
    """The link from `upper` (a downstream-facing port) to `lower` (the hop below)."""

    upper: str
    lower: str
    kind: str  # external | card_internal | switch_internal
    current_speed_gts: float | None
    current_width: int | None
    capable_speed_gts: float | None  # min of both ends' max
    capable_width: int | None
    limited_by: str | None  # bdf of the end whose max sets the capability; None: both equal
    downgraded_speed: bool
    downgraded_width: bool

    @property
    def downgraded(self) -> bool:
        return self.downgraded_speed or self.downgraded_width

    @property
    def bytes_per_second(self) -> float | None:
        return link_bytes_per_second(self.current_speed_gts, self.current_width)

    @property
    def capable_bytes_per_second(self) -> float | None:
        return link_bytes_per_second(self.capable_speed_gts, self.capable_width)

    @property
    def counts(self) -> bool:
        """Whether this link can be a bottleneck (switch-internal mirror values cannot)."""
        return self.kind != "switch_internal"

    def to_dict(self) -> dict[str, Any]:
        return {
            "upper": self.upper,
            "lower": self.lower,
            "kind": self.kind,
            "current_speed_gts": self.current_speed_gts,
            "current_width": self.current_width,
            "capable_speed_gts": self.capable_speed_gts,
            "capable_width": self.capable_width,
            "limited_by": self.limited_by,
            "downgraded_speed": self.downgraded_speed,
            "downgraded_width": self.downgraded_width,
            "bytes_per_second": self.bytes_per_second,
            "capable_bytes_per_second": self.capable_bytes_per_second,
        }


@dataclass(frozen=True)
class PcieHop:
    """One PCI function on a GPU's path, as its own sysfs attributes describe it."""

    bdf: str
    role: str  # root_port, switch_upstream, switch_downstream, card_upstream,
    # card_downstream, gpu, endpoint, bridge, unknown
    role_inferred: bool  # True: from position/class/ids, the config space was not readable
    vendor: str | None
    device: str | None
    class_code: str | None  # "0x030000"
    driver: str | None
    current_speed_gts: float | None
    max_speed_gts: float | None
    current_width: int | None
    max_width: int | None
    link: PcieLink | None  # the link to the hop above; None for root ports / internal bus
    # (a device on the root bus without a root port: its own link, upper = root complex)
    downgraded: bool = False  # an end of a downgraded link (above or below)
    aer: Mapping[str, int] = field(default_factory=dict)  # severity -> total
    config: PcieConfig | None = None
    errors: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "aer", _frozen(self.aer))
        object.__setattr__(self, "errors", _frozen(self.errors))

    @property
    def ids(self) -> str:
        return f"{self.vendor or '????'}:{self.device or '????'}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "bdf": self.bdf,
            "role": self.role,
            "role_inferred": self.role_inferred,
            "vendor": self.vendor,
            "device": self.device,
            "class": self.class_code,
            "driver": self.driver,
            "current_speed_gts": self.current_speed_gts,
            "max_speed_gts": self.max_speed_gts,
            "current_width": self.current_width,
            "max_width": self.max_width,
            "downgraded": self.downgraded,
            "link": self.link.to_dict() if self.link else None,
            "aer": dict(self.aer),
            "errors": dict(self.errors),
        }


@dataclass(frozen=True)
class Bar:
    index: int
    size_bytes: int
    prefetchable: bool
    is_64bit: bool


@dataclass(frozen=True)
class GpuPath:
    """One GPU and its path, root port first, the GPU function last."""

    bdf: str
    vendor: str | None
    device: str | None
    class_code: str | None
    driver: str | None
    numa_node: int | None
    busy: bool
    root_complex: str  # "pci0000:00"
    hops: tuple[PcieHop, ...]
    narrowest: int | None  # index into hops of the lower end of the narrowest link
    slot_link: int | None  # index of the hop whose link is the card's slot link
    bars: tuple[Bar, ...] = ()
    vram_bytes: int | None = None
    vram_visible_bytes: int | None = None
    kernel_vram_mib: tuple[int, int] | None = None  # (RAM, BAR) from "Detected VRAM"
    root_port_atomics: AtomicOps | None = None
    root_port_atomics_note: str | None = None  # why atomics are unknown
    dpm_pcie_active: tuple[float, int] | None = None  # amdgpu pp_dpm_pcie starred level
    errors: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "errors", _frozen(self.errors))

    @property
    def root_port(self) -> PcieHop | None:
        return self.hops[0] if self.hops and self.hops[0].role == "root_port" else None

    @property
    def narrowest_hop(self) -> PcieHop | None:
        return self.hops[self.narrowest] if self.narrowest is not None else None

    @property
    def narrowest_link(self) -> PcieLink | None:
        hop = self.narrowest_hop
        return hop.link if hop else None

    @property
    def bottleneck_bytes_per_second(self) -> float | None:
        link = self.narrowest_link
        return link.bytes_per_second if link else None

    @property
    def slot(self) -> PcieLink | None:
        return self.hops[self.slot_link].link if self.slot_link is not None else None

    def speed_drop_is_real(self, current_gts: float | None) -> bool:
        """Whether a link running slower than both ends can is a finding now: links slow
        down at idle (ASPM, amdgpu's dynamic PCIe), so only while the GPU works — or when
        amdgpu's own active `pp_dpm_pcie` level asks for more than the link runs."""
        if self.busy:
            return True
        return bool(self.dpm_pcie_active and current_gts and self.dpm_pcie_active[0] > current_gts)

    @property
    def large_bar(self) -> bool | None:
        """True: CPU-visible VRAM equals VRAM. None: no way to tell from this host."""
        if self.vram_bytes and self.vram_visible_bytes is not None:
            return self.vram_visible_bytes >= self.vram_bytes
        if self.kernel_vram_mib:
            ram, bar = self.kernel_vram_mib
            return bar >= ram
        if self.vram_bytes and self.bars:
            # No visible-VRAM figure (NVIDIA): the CPU sees VRAM through the largest BAR.
            return max(b.size_bytes for b in self.bars) >= self.vram_bytes
        return None

    @property
    def large_bar_note(self) -> str:
        if self.vram_bytes and self.vram_visible_bytes is not None:
            vis, tot = self.vram_visible_bytes, self.vram_bytes
            if vis >= tot:
                return f"large BAR active: CPU sees all {_size(tot)} of VRAM"
            return f"large BAR not active: CPU sees {_size(vis)} of {_size(tot)} VRAM"
        if self.kernel_vram_mib:
            ram, bar = self.kernel_vram_mib
            word = "active" if bar >= ram else "not active"
            return f"large BAR {word}: kernel log Detected VRAM RAM={ram}M, BAR={bar}M"
        if self.vram_bytes and self.bars:
            big = max(self.bars, key=lambda b: b.size_bytes)
            word = "active" if big.size_bytes >= self.vram_bytes else "not active"
            return f"large BAR {word}: BAR{big.index} {_size(big.size_bytes)} for {_size(self.vram_bytes)} VRAM"
        return "large BAR unknown: the driver exports no VRAM size (mem_info_vram_total)"

    def to_dict(self) -> dict[str, Any]:
        link = self.narrowest_link
        return {
            "bdf": self.bdf,
            "vendor": self.vendor,
            "device": self.device,
            "class": self.class_code,
            "driver": self.driver,
            "numa_node": self.numa_node,
            "busy": self.busy,
            "root_complex": self.root_complex,
            "root_port": self.root_port.bdf if self.root_port else None,
            "slot_link": self.slot_link,
            "narrowest": None
            if link is None
            else {
                "hop": self.narrowest,
                "upper": link.upper,
                "lower": link.lower,
                "bytes_per_second": link.bytes_per_second,
                "limited_by": link.limited_by,
            },
            "hops": [
                {**h.to_dict(), "narrowest": i == self.narrowest} for i, h in enumerate(self.hops)
            ],
            "bars": [
                {"index": b.index, "size_bytes": b.size_bytes, "prefetchable": b.prefetchable, "is_64bit": b.is_64bit}
                for b in self.bars
            ],
            "vram_bytes": self.vram_bytes,
            "vram_visible_bytes": self.vram_visible_bytes,
            "large_bar": self.large_bar,
            "large_bar_note": self.large_bar_note,
            "kernel_vram": None
            if self.kernel_vram_mib is None
            else {"ram_mib": self.kernel_vram_mib[0], "bar_mib": self.kernel_vram_mib[1]},
            "root_port_atomics": None
            if self.root_port_atomics is None
            else {
                "routing": self.root_port_atomics.routing,
                "completer32": self.root_port_atomics.completer32,
                "completer64": self.root_port_atomics.completer64,
                "completer128_cas": self.root_port_atomics.completer128_cas,
            },
            "root_port_atomics_note": self.root_port_atomics_note,
            "dpm_pcie_active": None
            if self.dpm_pcie_active is None
            else {"speed_gts": self.dpm_pcie_active[0], "width": self.dpm_pcie_active[1]},
            "errors": dict(self.errors),
        }


@dataclass(frozen=True)
class GpuPair:
    """Where two GPUs' paths meet, and whether each can reach the other's VRAM
    peer-to-peer (gpuguard.hw.pcie_p2p: the kernel's rules, per direction)."""

    a: str
    b: str
    meet: str  # switch | root_port | host_bridge
    at: str | None  # bdf of the common port, or the root complex(es)
    at_ids: str | None  # vendor:device of that port
    host_bridge: str | None  # vendor:device of the host bridge(s) involved
    p2p: str  # yes | no | one-way | maybe
    across_root_complexes: bool = False  # the paths start in different pciDDDD:BB domains
    across_numa_nodes: bool = False  # the GPUs hang off different CPU sockets
    directions: tuple[PeerDirection, ...] = ()  # (a→b, b→a)

    @property
    def meeting(self) -> str:
        if self.meet == "switch":
            return f"meet under switch {self.at} ({self.at_ids})"
        if self.meet == "root_port":
            return f"meet at root port {self.at} ({self.at_ids})"
        hb = self.host_bridge or "unknown host bridge"
        if self.across_numa_nodes:
            return f"meet at host bridges {hb} on different CPU sockets ({self.at})"
        if self.across_root_complexes:
            return f"meet at host bridge {hb} across root complexes ({self.at})"
        return f"meet at host bridge {hb} ({self.at})"

    @property
    def p2p_text(self) -> str:
        """`one-way (a→b)` names the direction that works."""
        if self.p2p == "one-way":
            ok = next(d for d in self.directions if d.possible)
            return f"one-way ({short_bdf(ok.reader)}→{short_bdf(ok.owner)})"
        return self.p2p

    @property
    def verdict(self) -> str:
        if not self.directions:
            return self.meeting
        if self.p2p == "yes":
            return f"{self.meeting}: P2P both ways ({self.directions[0].reason})"
        if self.p2p == "no" and len({d.reason for d in self.directions}) == 1:
            return f"{self.meeting}: no P2P: {self.directions[0].reason}"
        parts = [
            f"{short_bdf(d.reader)}→{short_bdf(d.owner)} "
            f"{'yes' if d.possible else 'no' if d.possible is False else 'unknown'}: {d.reason}"
            for d in self.directions
        ]
        head = {"no": "no P2P", "one-way": "P2P one way only", "maybe": "P2P unknown"}[self.p2p]
        return f"{self.meeting}: {head}; " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "meet": self.meet,
            "at": self.at,
            "at_ids": self.at_ids,
            "host_bridge": self.host_bridge,
            "p2p": self.p2p,
            "directions": [d.to_dict() for d in self.directions],
            "across_root_complexes": self.across_root_complexes,
            "across_numa_nodes": self.across_numa_nodes,
            "verdict": self.verdict,
        }


@dataclass(frozen=True)
class PcieReport:
    gpus: tuple[GpuPath, ...]
    pairs: tuple[GpuPair, ...]
    host_bridges: Mapping[str, str | None]  # root complex -> vendor:device
    nvswitches: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # host-wide read problems, described

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_bridges", _frozen(self.host_bridges))

    def gpu(self, bdf: str) -> GpuPath | None:
        return next((g for g in self.gpus if g.bdf == bdf), None)

    def pair(self, a: str, b: str) -> GpuPair | None:
        return next((p for p in self.pairs if {p.a, p.b} == {a, b}), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "gpus": [g.to_dict() for g in self.gpus],
            "pairs": [p.to_dict() for p in self.pairs],
            "host_bridges": dict(self.host_bridges),
            "nvswitches": list(self.nvswitches),
            "problems": list(self.problems),
        }


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB".replace(".0 ", " ")
    return f"{n / (1 << 20):.0f} MiB"


# ---------------------------------------------------------------- reading


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


def _role(dev: _Device, position: int, parent_role: str | None, is_last: bool) -> tuple[str, bool]:
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
    ends_speed = [(v, b) for v, b in ((parent.max_speed, parent.bdf), (child.max_speed, child.bdf)) if v]
    ends_width = [(v, b) for v, b in ((parent.max_width, parent.bdf), (child.max_width, child.bdf)) if v]
    cap_speed = min(v for v, _ in ends_speed) if ends_speed else None
    cap_width = min(v for v, _ in ends_width) if ends_width else None
    limited_by = None
    if len(ends_speed) == 2 and ends_speed[0][0] != ends_speed[1][0]:
        limited_by = min(ends_speed)[1]
    elif len(ends_width) == 2 and ends_width[0][0] != ends_width[1][0]:
        limited_by = min(ends_width)[1]
    counts = kind != "switch_internal"
    return PcieLink(
        upper=parent.bdf,
        lower=child.bdf,
        kind=kind,
        current_speed_gts=cur_speed,
        current_width=cur_width,
        capable_speed_gts=cap_speed,
        capable_width=cap_width,
        limited_by=limited_by,
        downgraded_speed=bool(counts and cur_speed and cap_speed and cur_speed < cap_speed),
        downgraded_width=bool(counts and cur_width and cap_width and cur_width < cap_width),
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
        downgraded_speed=bool(dev.cur_speed and dev.max_speed and dev.cur_speed < dev.max_speed),
        downgraded_width=bool(dev.cur_width and dev.max_width and dev.cur_width < dev.max_width),
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


def parse_dpm_pcie(text: str) -> tuple[float, int] | None:
    """amdgpu `pp_dpm_pcie`: the active (starred) level's speed and width. RDNA3 may star
    several levels at once (reference/amdgpu/SOURCES.md): take the fastest."""
    levels = [(float(s), int(w)) for s, w in DPM_PCIE_RE.findall(text)]
    return max(levels) if levels else None


def kernel_vram(lines: Iterable[str], gpu_bdfs: list[str]) -> dict[str, tuple[int, int]]:
    """`Detected VRAM RAM=…M, BAR=…M` per GPU. A line without a PCI address is attributed
    only when exactly one AMD GPU exists (the figure is amdgpu's)."""
    found: dict[str, tuple[int, int]] = {}
    for line in lines:
        m = VRAM_LINE_RE.search(line)
        if not m:
            continue
        fig = (int(m.group(1)), int(m.group(2)))
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
    kvram: tuple[int, int] | None,
    vram_other: int | None = None,
) -> GpuPath:
    roles: list[tuple[str, bool]] = []
    for i, d in enumerate(devs):
        roles.append(_role(d, i, roles[-1][0] if roles else None, i == len(devs) - 1))
    links: list[PcieLink | None] = [_root_bus_link(complex_, devs[0], roles[0][0])]
    for i in range(1, len(devs)):
        links.append(_link(devs[i - 1], roles[i - 1][0], devs[i], roles[i][0]))
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
                aer=d.aer,
                config=d.config,
                errors=d.errors,
            )
        )
    # Narrowest: the slowest link that is a real link; on a tie the one nearest the root.
    narrowest = None
    best = None
    for i, h in enumerate(hops):
        if h.link is None or not h.link.counts or h.link.bytes_per_second is None:
            continue
        if best is None or h.link.bytes_per_second < best:
            narrowest, best = i, h.link.bytes_per_second
    # The slot link: the first real link above the GPU that is not inside the card.
    slot = None
    for i in range(len(hops) - 1, -1, -1):
        lk = hops[i].link
        if lk is not None and lk.kind == "external":
            slot = i
            break

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
        narrowest=narrowest,
        slot_link=slot,
        bars=bars,
        vram_bytes=vram,
        vram_visible_bytes=vis,
        kernel_vram_mib=kvram,
        root_port_atomics=atomics,
        root_port_atomics_note=note,
        dpm_pcie_active=dpm,
        errors=r.errors,
    )


# ---------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float
    type: str = "gauge"  # gauge | counter


def samples(report: PcieReport, gpu_names: Mapping[str, str] = MappingProxyType({})) -> Iterator[Sample]:
    """The PCIe metrics of reference/METRICS.md from one report. `gpu_names[bdf]` is the
    configured name (default `card` + PCI address). A value that is unknown is left out,
    never exported as zero."""
    aer_seen: set[str] = set()
    # The GPUs behind each hop, so an AER alert names them; a switch or root
    # port shared by several GPUs names them all, comma-separated, in one series.
    behind: dict[str, list[str]] = {}
    for g in report.gpus:
        for h in g.hops:
            behind.setdefault(h.bdf, []).append(gpu_names.get(g.bdf, f"card{g.bdf}"))
    for g in report.gpus:
        gpu = gpu_names.get(g.bdf, f"card{g.bdf}")
        for i, h in enumerate(g.hops):
            lab = {"gpu": gpu, "bdf": h.bdf, "hop": str(i), "role": h.role}
            for name, v in (
                ("gpuguard_pcie_link_current_transfers_per_second", h.current_speed_gts),
                ("gpuguard_pcie_link_max_transfers_per_second", h.max_speed_gts),
            ):
                if v is not None:
                    yield Sample(name, lab, v * 1e9)
            for name, w in (
                ("gpuguard_pcie_link_current_width", h.current_width),
                ("gpuguard_pcie_link_max_width", h.max_width),
            ):
                if w is not None:
                    yield Sample(name, lab, float(w))
            yield Sample("gpuguard_pcie_link_downgraded", lab, 1.0 if h.downgraded else 0.0)
            if h.bdf not in aer_seen:
                aer_seen.add(h.bdf)
                for sev, n in h.aer.items():
                    yield Sample("gpuguard_pcie_aer_errors_total",
                                 {"bdf": h.bdf, "gpu": ",".join(sorted(set(behind[h.bdf]))), "severity": sev},
                                 float(n), "counter")
        bw = g.bottleneck_bytes_per_second
        if bw is not None:
            yield Sample("gpuguard_gpu_pcie_bottleneck_bytes_per_second", {"gpu": gpu}, bw)
        for b in g.bars:
            yield Sample("gpuguard_gpu_bar_bytes", {"gpu": gpu, "bar": str(b.index)}, float(b.size_bytes))
    for p in report.pairs:
        a, b = gpu_names.get(p.a, f"card{p.a}"), gpu_names.get(p.b, f"card{p.b}")
        for d in p.directions:
            if d.possible is None:
                continue  # unknown is left out, never a zero
            way = "a_to_b" if d.reader == p.a else "b_to_a"
            yield Sample("gpuguard_gpu_pair_p2p", {"a": a, "b": b, "direction": way}, 1.0 if d.possible else 0.0)


METRIC_HELP = {
    "gpuguard_pcie_link_current_transfers_per_second": "Current PCIe link speed per lane of a hop (transfers/s)",
    "gpuguard_pcie_link_max_transfers_per_second": "Maximum PCIe link speed per lane the hop supports (transfers/s)",
    "gpuguard_pcie_link_current_width": "Current PCIe link width of a hop (lanes)",
    "gpuguard_pcie_link_max_width": "Maximum PCIe link width of a hop (lanes)",
    "gpuguard_pcie_link_downgraded": "1 when the hop is an end of a link running below what both ends support",
    "gpuguard_gpu_pcie_bottleneck_bytes_per_second": "Usable bandwidth of the GPU's narrowest PCIe hop (bytes/s, per direction)",
    "gpuguard_pcie_aer_errors_total": "PCIe AER errors counted by the kernel per device",
    "gpuguard_gpu_bar_bytes": "Size of a GPU BAR (bytes)",
    "gpuguard_gpu_pair_p2p": "1 when GPU a (a_to_b) or b (b_to_a) can access the other's VRAM peer-to-peer by the kernel's rules (large BAR of the accessed card, p2pdma path)",
}


class PcieCollector:
    """A prometheus_client custom collector over the latest report; `collect()` formats
    memory only, it never touches hardware (client_python runs it on the event loop)."""

    def __init__(self, latest, gpu_names=lambda: {}) -> None:
        self._latest = latest  # () -> PcieReport | None
        self._names = gpu_names  # () -> Mapping[bdf, name]

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        report = self._latest()
        families: dict[str, Any] = {}
        if report is None:
            return
        for s in samples(report, self._names()):
            fam = families.get(s.name)
            if fam is None:
                if s.type == "counter":
                    fam = CounterMetricFamily(s.name[: -len("_total")], METRIC_HELP[s.name], labels=list(s.labels))
                else:
                    fam = GaugeMetricFamily(s.name, METRIC_HELP[s.name], labels=list(s.labels))
                families[s.name] = fam
            fam.add_metric(list(s.labels.values()), s.value)
        yield from families.values()
