"""PCI configuration-space parsing: the bytes of a device's sysfs `config` file in, the
few facts gpuguard needs out (header type, PCIe port type, link capability/status,
AtomicOp completer bits). Pure functions over bytes; no file access here.

A reader without CAP_SYS_ADMIN gets only the first 64 bytes of `config` (the kernel
truncates it), and the capability list lives above 0x40: then every capability-derived
answer is None with `truncated=True`, never a guess.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# Offsets in the standard header and the PCI Express capability (PCIe base spec 7.5).
CAP_POINTER = 0x34
STATUS = 0x06
STATUS_CAP_LIST = 0x10
HEADER_TYPE = 0x0E
CAP_ID_PCIE = 0x10
PCIE_CAPS = 0x02
PCIE_LINK_CAP = 0x0C
PCIE_LINK_STATUS = 0x12
PCIE_DEV_CAP2 = 0x24
UNPRIVILEGED_CONFIG_BYTES = 64

# Device/Port Type field (PCI Express Capabilities register bits 7:4).
PORT_TYPES = {
    0x0: "endpoint",
    0x1: "legacy_endpoint",
    0x4: "root_port",
    0x5: "switch_upstream",
    0x6: "switch_downstream",
    0x7: "pcie_to_pci_bridge",
    0x8: "pci_to_pcie_bridge",
    0x9: "rc_integrated_endpoint",
    0xA: "rc_event_collector",
}

# Link Capabilities / Link Status speed field: index into the supported-speeds vector,
# which is contiguous on every device that exists (1 = 2.5 GT/s ... 6 = 64 GT/s).
LINK_SPEED_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


@dataclass(frozen=True)
class AtomicOps:
    """Device Capabilities 2 AtomicOp bits of one port (INCIDENTS §6)."""

    routing: bool  # bit 6: routes AtomicOps between its ports
    completer32: bool  # bit 7
    completer64: bool  # bit 8
    completer128_cas: bool  # bit 9

    @property
    def completes_32_64(self) -> bool:
        return self.completer32 and self.completer64

    def describe(self) -> str:
        """The lspci spelling: `Routing+ 32bit+ 64bit+ 128bitCAS-`."""

        def flag(name: str, on: bool) -> str:
            return f"{name}{'+' if on else '-'}"

        return " ".join(
            (
                flag("Routing", self.routing),
                flag("32bit", self.completer32),
                flag("64bit", self.completer64),
                flag("128bitCAS", self.completer128_cas),
            )
        )


@dataclass(frozen=True)
class PcieConfig:
    """What the config bytes say. `None` fields were not readable (truncated config, no
    PCIe capability, malformed list); `truncated` says why most often."""

    size: int
    vendor: str | None = None  # "1002"
    device: str | None = None
    header_type: int | None = None  # 0 endpoint, 1 PCI-PCI bridge
    truncated: bool = False  # only the unprivileged 64 bytes were readable
    has_pcie: bool | None = None  # None: could not tell (truncated)
    port_type: str | None = None  # PORT_TYPES value
    max_speed_gts: float | None = None
    max_width: int | None = None
    current_speed_gts: float | None = None
    current_width: int | None = None
    atomics: AtomicOps | None = None
    problem: str | None = None  # a malformed capability list, described


def _u8(data: bytes, off: int) -> int | None:
    return data[off] if 0 <= off < len(data) else None


def _u16(data: bytes, off: int) -> int | None:
    if off < 0 or off + 2 > len(data):
        return None
    return struct.unpack_from("<H", data, off)[0]


def _u32(data: bytes, off: int) -> int | None:
    if off < 0 or off + 4 > len(data):
        return None
    return struct.unpack_from("<I", data, off)[0]


def find_capability(data: bytes, cap_id: int) -> int | None:
    """Offset of capability `cap_id` in the standard list, or None. Raises ValueError on a
    looping or out-of-range list (garbage config must not hang the walker)."""
    status = _u16(data, STATUS)
    if status is None or not status & STATUS_CAP_LIST:
        return None
    ptr = _u8(data, CAP_POINTER)
    seen: set[int] = set()
    while ptr:
        ptr &= 0xFC  # the low two bits are reserved
        if ptr < 0x40:
            raise ValueError(f"capability pointer 0x{ptr:02x} points into the header")
        if ptr in seen:
            raise ValueError(f"capability list loops at 0x{ptr:02x}")
        seen.add(ptr)
        cid = _u8(data, ptr)
        nxt = _u8(data, ptr + 1)
        if cid is None or nxt is None:
            raise ValueError(f"capability at 0x{ptr:02x} lies beyond the {len(data)} bytes read")
        if cid == cap_id:
            return ptr
        ptr = nxt
    return None


def parse_config(data: bytes) -> PcieConfig:
    """Parse a `config` file's bytes. Never raises: problems land in `.problem`."""
    size = len(data)
    vendor = _u16(data, 0x00)
    device = _u16(data, 0x02)
    header = _u8(data, HEADER_TYPE)
    base = dict(
        size=size,
        vendor=f"{vendor:04x}" if vendor is not None else None,
        device=f"{device:04x}" if device is not None else None,
        header_type=(header & 0x7F) if header is not None else None,
    )
    if size <= UNPRIVILEGED_CONFIG_BYTES:
        return PcieConfig(**base, truncated=True)
    try:
        cap = find_capability(data, CAP_ID_PCIE)
    except ValueError as e:
        return PcieConfig(**base, problem=str(e))
    if cap is None:
        return PcieConfig(**base, has_pcie=False)
    caps = _u16(data, cap + PCIE_CAPS)
    link_cap = _u32(data, cap + PCIE_LINK_CAP)
    link_status = _u16(data, cap + PCIE_LINK_STATUS)
    devcap2 = _u32(data, cap + PCIE_DEV_CAP2)
    port_type = PORT_TYPES.get((caps >> 4) & 0xF, "unknown") if caps is not None else None
    version = caps & 0xF if caps is not None else 0
    atomics = None
    # Device Capabilities 2 exists from capability version 2 on.
    if devcap2 is not None and version >= 2:
        atomics = AtomicOps(
            routing=bool(devcap2 & (1 << 6)),
            completer32=bool(devcap2 & (1 << 7)),
            completer64=bool(devcap2 & (1 << 8)),
            completer128_cas=bool(devcap2 & (1 << 9)),
        )

    def speed(v: int | None) -> float | None:
        return LINK_SPEED_GTS.get(v & 0xF) if v is not None else None

    def width(v: int | None) -> int | None:
        w = (v >> 4) & 0x3F if v is not None else 0
        return w or None

    return PcieConfig(
        **base,
        has_pcie=True,
        port_type=port_type,
        max_speed_gts=speed(link_cap),
        max_width=width(link_cap),
        current_speed_gts=speed(link_status),
        current_width=width(link_status),
        atomics=atomics,
    )


def build_config(
    vendor: int,
    device: int,
    class_code: int,
    *,
    header_type: int = 0,
    port_type: int | None = None,
    max_speed: int = 0,
    max_width: int = 0,
    cur_speed: int = 0,
    cur_width: int = 0,
    devcap2: int = 0,
    size: int = 256,
    cap_offset: int = 0x80,
) -> bytes:
    """Config-space bytes with a real capability list (a power-management capability at
    0x40 chaining to the PCIe capability), for simulated trees and tests. Speeds are the
    register encodings (1 = 2.5 GT/s ... 5 = 32 GT/s)."""
    buf = bytearray(max(size, 0x100) if size > UNPRIVILEGED_CONFIG_BYTES else 0x100)
    struct.pack_into("<HH", buf, 0, vendor, device)
    struct.pack_into("<I", buf, 0x08, (class_code << 8) | 0x01)
    buf[HEADER_TYPE] = header_type
    if port_type is not None:
        struct.pack_into("<H", buf, STATUS, STATUS_CAP_LIST)
        buf[CAP_POINTER] = 0x40
        buf[0x40] = 0x01  # PCI power management
        buf[0x41] = cap_offset
        buf[cap_offset] = CAP_ID_PCIE
        buf[cap_offset + 1] = 0x00
        struct.pack_into("<H", buf, cap_offset + PCIE_CAPS, (port_type << 4) | 0x2)
        struct.pack_into("<I", buf, cap_offset + PCIE_LINK_CAP, (max_width << 4) | max_speed)
        struct.pack_into("<H", buf, cap_offset + PCIE_LINK_STATUS, (cur_width << 4) | cur_speed)
        struct.pack_into("<I", buf, cap_offset + PCIE_DEV_CAP2, devcap2)
    return bytes(buf[:size])
