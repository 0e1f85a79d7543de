"""The PCIe report as immutable values: each GPU's path from its root port down to the GPU
function, the links between the hops, the narrowest hop (the GPU's real bandwidth ceiling),
BARs and large-BAR state, where GPU pairs meet (switch / root port / host bridge) and
whether they reach each other peer-to-peer, the root port's AtomicOp completer support and
AER counters. The walk (gpuguard.hw.pcie) builds it; the verdicts it states are in
gpuguard.hw.pcie_verdict; /metrics formats it in gpuguard.sinks.pcie_metrics.

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

The JSON document (`gpuguard pcie --json`, GET /v1/pcie) is `document(report)`
(gpuguard.document): each class's `DOCUMENT` lists its keys in order. Its JSON Schema is
`json_schema()`, published as docs/pcie.schema.json (a test keeps the file equal to it and
validates real reports against it). Speeds are GT/s per lane, bandwidths bytes per second
per direction; null means the value could not be read (the reason is in that hop's or
GPU's `errors`), never zero. Only the standard library is imported here (the capture and
`pcie --json` must run on a bare GPU host).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

from gpuguard.document import json_schema as _json_schema
from gpuguard.hw import pcie_verdict as verdict
from gpuguard.hw.pci_address import short_bdf
from gpuguard.hw.pcie_config import AtomicOps, PcieConfig
from gpuguard.hw.pcie_p2p import PeerDirection

SCHEMA_VERSION = 1

LinkKind = Literal["external", "card_internal", "switch_internal"]
HopRole = Literal["root_port", "switch_upstream", "switch_downstream", "card_upstream", "card_downstream",
                  "gpu", "endpoint", "bridge", "unknown"]
Meet = Literal["switch", "root_port", "host_bridge"]
P2p = Literal["yes", "no", "one-way", "maybe"]


def _frozen(m: Mapping | None) -> Mapping:
    return MappingProxyType(dict(m or {}))


def format_speed(gts: float | None) -> str:
    return "?" if gts is None else f"{gts:.1f}"


def format_gbps(bps: float | None) -> str:
    return "?" if bps is None else f"{bps / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class PcieLink:
    """The link from `upper` (a downstream-facing port) to `lower` (the hop below)."""

    upper: str
    lower: str
    kind: LinkKind
    current_speed_gts: float | None
    current_width: int | None
    capable_speed_gts: float | None  # min of both ends' max
    capable_width: int | None
    limited_by: str | None  # bdf of the end whose max sets the capability; None: both equal
    downgraded_speed: bool
    downgraded_width: bool

    DOCUMENT: ClassVar = (
        "upper", "lower", "kind", "current_speed_gts", "current_width", "capable_speed_gts", "capable_width",
        "limited_by", "downgraded_speed", "downgraded_width", "bytes_per_second", "capable_bytes_per_second",
    )

    @property
    def downgraded(self) -> bool:
        return self.downgraded_speed or self.downgraded_width

    @property
    def bytes_per_second(self) -> float | None:
        """Usable bandwidth now, per direction."""
        return verdict.link_bytes_per_second(self.current_speed_gts, self.current_width)

    @property
    def capable_bytes_per_second(self) -> float | None:
        """Usable bandwidth at what both ends can, per direction."""
        return verdict.link_bytes_per_second(self.capable_speed_gts, self.capable_width)

    @property
    def counts(self) -> bool:
        """Whether this link can be a bottleneck (switch-internal mirror values cannot)."""
        return self.kind != "switch_internal"


@dataclass(frozen=True)
class PcieHop:
    """One PCI function on a GPU's path, as its own sysfs attributes describe it."""

    bdf: str
    role: HopRole
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
    narrowest: bool = False  # the lower end of the GPU's narrowest link
    aer: Mapping[str, int] = field(default_factory=dict)  # severity -> total
    config: PcieConfig | None = None
    errors: Mapping[str, str] = field(default_factory=dict)  # attribute -> why it is unreadable

    DOCUMENT: ClassVar = (
        "bdf", "role", "role_inferred", "vendor", "device", ("class", "class_code"), "driver",
        "current_speed_gts", "max_speed_gts", "current_width", "max_width", "downgraded", "link", "aer", "errors",
        "narrowest",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "aer", _frozen(self.aer))
        object.__setattr__(self, "errors", _frozen(self.errors))

    @property
    def ids(self) -> str:
        return f"{self.vendor or '????'}:{self.device or '????'}"


@dataclass(frozen=True)
class Bar:
    """A memory BAR of the GPU function (I/O BARs are not VRAM windows)."""

    index: int
    size_bytes: int
    prefetchable: bool
    is_64bit: bool


@dataclass(frozen=True)
class KernelVram:
    """amdgpu's `Detected VRAM RAM=…M, BAR=…M` line, in MiB."""

    ram_mib: int
    bar_mib: int


@dataclass(frozen=True)
class DpmPcieLevel:
    """amdgpu's active (starred) `pp_dpm_pcie` level."""

    speed_gts: float
    width: int


@dataclass(frozen=True)
class Bottleneck:
    """The GPU's narrowest link: the lower end's hop index, the link's ends, its usable
    bandwidth and the end whose maximum limits it."""

    hop: int
    upper: str
    lower: str
    bytes_per_second: float | None
    limited_by: str | None


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
    slot_link: int | None  # index of the hop whose link is the card's slot link
    bars: tuple[Bar, ...] = ()
    vram_bytes: int | None = None
    vram_visible_bytes: int | None = None
    kernel_vram: KernelVram | None = None
    root_port_atomics: AtomicOps | None = None
    root_port_atomics_note: str | None = None  # why atomics are unknown
    dpm_pcie_active: DpmPcieLevel | None = None
    errors: Mapping[str, str] = field(default_factory=dict)

    DOCUMENT: ClassVar = (
        "bdf", "vendor", "device", ("class", "class_code"), "driver", "numa_node", "busy", "root_complex",
        ("root_port", "root_port_bdf"), "slot_link", ("narrowest", "bottleneck"), "hops", "bars", "vram_bytes",
        "vram_visible_bytes", "large_bar", "large_bar_note", "kernel_vram", "root_port_atomics",
        "root_port_atomics_note", "dpm_pcie_active", "errors",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "errors", _frozen(self.errors))

    @property
    def root_port(self) -> PcieHop | None:
        return self.hops[0] if self.hops and self.hops[0].role == "root_port" else None

    @property
    def root_port_bdf(self) -> str | None:
        """The root port above the GPU; null when the GPU sits on the root bus."""
        rp = self.root_port
        return rp.bdf if rp else None

    @property
    def narrowest(self) -> int | None:
        """Index into hops of the lower end of the narrowest link."""
        return next((i for i, h in enumerate(self.hops) if h.narrowest), None)

    @property
    def narrowest_hop(self) -> PcieHop | None:
        i = self.narrowest
        return self.hops[i] if i is not None else None

    @property
    def narrowest_link(self) -> PcieLink | None:
        hop = self.narrowest_hop
        return hop.link if hop else None

    @property
    def bottleneck(self) -> Bottleneck | None:
        """The narrowest link (the GPU's real bandwidth ceiling); null when no hop reports one."""
        i, link = self.narrowest, self.narrowest_link
        if i is None or link is None:
            return None
        return Bottleneck(i, link.upper, link.lower, link.bytes_per_second, link.limited_by)

    @property
    def bottleneck_bytes_per_second(self) -> float | None:
        link = self.narrowest_link
        return link.bytes_per_second if link else None

    @property
    def slot(self) -> PcieLink | None:
        return self.hops[self.slot_link].link if self.slot_link is not None else None

    def speed_drop_is_real(self, current_gts: float | None) -> bool:
        return verdict.speed_drop_is_real(
            self.busy, self.dpm_pcie_active.speed_gts if self.dpm_pcie_active else None, current_gts)

    def _bar_figures(self) -> tuple[int | None, int | None, tuple[int, int] | None, tuple[int, int] | None]:
        kernel = (self.kernel_vram.ram_mib, self.kernel_vram.bar_mib) if self.kernel_vram else None
        big = max(self.bars, key=lambda b: b.size_bytes) if self.bars else None
        return self.vram_bytes, self.vram_visible_bytes, kernel, (big.index, big.size_bytes) if big else None

    @property
    def large_bar(self) -> bool | None:
        """True: CPU-visible VRAM equals VRAM. Null: no way to tell from this host."""
        return verdict.large_bar(*self._bar_figures())

    @property
    def large_bar_note(self) -> str:
        """The large-BAR verdict in words, naming the figures it rests on."""
        return verdict.large_bar_note(*self._bar_figures())


@dataclass(frozen=True)
class GpuPair:
    """Where two GPUs' paths meet, and whether each can reach the other's VRAM
    peer-to-peer (gpuguard.hw.pcie_p2p: the kernel's rules, per direction)."""

    a: str
    b: str
    meet: Meet
    at: str | None  # bdf of the common port, or the root complex(es)
    at_ids: str | None  # vendor:device of that port
    host_bridge: str | None  # vendor:device of the host bridge(s) involved
    p2p: P2p
    across_root_complexes: bool = False  # the paths start in different pciDDDD:BB domains
    across_numa_nodes: bool = False  # the GPUs hang off different CPU sockets
    directions: tuple[PeerDirection, ...] = ()  # (a→b, b→a)

    DOCUMENT: ClassVar = (
        "a", "b", "meet", "at", "at_ids", "host_bridge", "p2p", "directions", "across_root_complexes",
        "across_numa_nodes", "verdict",
    )

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
        """Where the pair meets and what that means for P2P, per direction when they differ."""
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


@dataclass(frozen=True)
class PcieReport:
    """Every GPU's PCIe path, every GPU pair, the host bridges, NVSwitch functions and the
    host-wide read problems of one walk."""

    gpus: tuple[GpuPath, ...]
    pairs: tuple[GpuPair, ...]
    host_bridges: Mapping[str, str | None]  # root complex -> vendor:device
    nvswitches: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # host-wide read problems, described

    DOCUMENT: ClassVar = ("schema", "gpus", "pairs", "host_bridges", "nvswitches", "problems")

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_bridges", _frozen(self.host_bridges))

    @property
    def schema(self) -> Literal[1]:
        """Version of this document's layout; a change that breaks readers raises it."""
        return SCHEMA_VERSION

    def gpu(self, bdf: str) -> GpuPath | None:
        return next((g for g in self.gpus if g.bdf == bdf), None)

    def pair(self, a: str, b: str) -> GpuPair | None:
        return next((p for p in self.pairs if {p.a, p.b} == {a, b}), None)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of `gpuguard pcie --json` (published as docs/pcie.schema.json)."""
    return _json_schema(
        PcieReport,
        title="gpuguard pcie --json",
        description=(
            "The PCIe path of every GPU (`gpuguard pcie --json`; GET /v1/pcie adds `findings`). "
            "Speeds are GT/s per lane, bandwidths bytes per second per direction, sizes bytes; "
            "null means the value could not be read (the reason is in that hop's or GPU's `errors`), never zero."
        ),
    )
