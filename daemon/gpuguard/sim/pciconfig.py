"""Binary PCI configuration space of a simulated function (the sysfs `config` file).

Owns: the type 0/1 header (ids, class, bus numbers), the capability list (PM, PCI
Express, MSI) with real register layouts — PCIe Capabilities port type, Link
Capabilities/Status (speed and width), Device Capabilities 2 AtomicOp completer bits —
and an AER extended capability, so `lspci -F`-style and hand-rolled parsers both work.
The sim serves all 4096 bytes to every reader; the kernel gives non-root readers only
the first 64 bytes (a simplification, see SimHost.read).
"""
from __future__ import annotations

import struct

from .topology import PciFunction

SPEED_CODE = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5}
CAP_PM, CAP_EXP, CAP_MSI = 0x50, 0x64, 0xA0

# Device Capabilities 2 bits (PCIe base spec 7.5.3.15)
DEVCAP2_ATOMIC_ROUTE = 1 << 6
DEVCAP2_ATOMIC_COMP32 = 1 << 7
DEVCAP2_ATOMIC_COMP64 = 1 << 8
DEVCAP2_ATOMIC_COMP128 = 1 << 9


def config_space(fn: PciFunction, present: bool = True) -> bytes:
    """4096 bytes of config space; a function that fell off the bus reads all ones."""
    if not present:
        return b"\xff" * 4096
    cs = bytearray(4096)
    bridge = fn.class_code >> 8 == 0x0604
    struct.pack_into("<HH", cs, 0x00, fn.vendor, fn.device)
    struct.pack_into("<HH", cs, 0x04, 0x0407, 0x0010)        # command; status: cap list
    struct.pack_into("<I", cs, 0x08, (fn.class_code << 8) | fn.revision)
    cs[0x0E] = 0x01 if bridge else 0x00
    if bridge:
        primary = int(fn.bdf.split(":")[1], 16)
        cs[0x18] = primary
        cs[0x19] = fn.secondary or 0
        cs[0x1A] = fn.subordinate or 0
    else:
        for idx, start, size, flags in fn.bars:
            if idx < 6:
                off = 0x10 + idx * 4
                if flags & 0x100:      # IO
                    struct.pack_into("<I", cs, off, (start & ~0x3) | 0x1)
                elif flags & 0x100000:  # 64-bit prefetchable memory
                    struct.pack_into("<Q", cs, off, (start & ~0xF) | 0xC)
                else:
                    struct.pack_into("<I", cs, off, start & ~0xF)
        struct.pack_into("<HH", cs, 0x2C, fn.subsystem_vendor, fn.subsystem_device)
    if fn.port_type is None:                                   # host bridge: PM cap only
        cs[0x34] = CAP_PM
        cs[CAP_PM:CAP_PM + 2] = bytes((0x01, 0x00))
        return bytes(cs)
    cs[0x34] = CAP_PM
    cs[CAP_PM:CAP_PM + 2] = bytes((0x01, CAP_EXP))
    struct.pack_into("<H", cs, CAP_PM + 2, 0x0003)
    e = CAP_EXP
    cs[e:e + 2] = bytes((0x10, CAP_MSI))
    slot = fn.port_type in (4, 6)
    struct.pack_into("<H", cs, e + 0x02, 0x0002 | (fn.port_type << 4) | (0x0100 if slot else 0))
    struct.pack_into("<I", cs, e + 0x04, 0x00008FC2)           # DevCap: MPS 512, RBER
    struct.pack_into("<HH", cs, e + 0x08, 0x2930, 0x0010)
    max_code = SPEED_CODE.get(fn.max_speed, 1)
    cur_code = SPEED_CODE.get(fn.cur_speed, max_code)
    port_no = int(fn.bdf.split(":")[2].split(".")[0], 16)
    struct.pack_into("<I", cs, e + 0x0C, (port_no << 24) | 0x00700C00 | (fn.max_width << 4) | max_code)
    struct.pack_into("<HH", cs, e + 0x10, 0x0040, 0x2000 | (fn.cur_width << 4) | cur_code)
    devcap2 = 0x0000001F | (1 << 4)
    if fn.port_type in (4, 5, 6):
        devcap2 |= DEVCAP2_ATOMIC_ROUTE if fn.port_type != 4 else 0
    if fn.atomics:
        devcap2 |= DEVCAP2_ATOMIC_COMP32 | DEVCAP2_ATOMIC_COMP64 | DEVCAP2_ATOMIC_COMP128
    struct.pack_into("<I", cs, e + 0x24, devcap2)
    supported = sum(1 << (c) for c in range(1, max_code + 1))   # Link Cap 2 speed vector
    struct.pack_into("<I", cs, e + 0x2C, supported)
    struct.pack_into("<H", cs, e + 0x30, max_code)             # Link Control 2 target speed
    cs[CAP_MSI:CAP_MSI + 2] = bytes((0x05, 0x00))
    struct.pack_into("<H", cs, CAP_MSI + 2, 0x0080)
    # AER extended capability (id 1, version 2) at 0x100, end of list.
    struct.pack_into("<I", cs, 0x100, 0x0001 | (2 << 16))
    return bytes(cs)


def parse_link(cs: bytes) -> dict:
    """Decode the fields tests check (the inverse of config_space for the PCIe cap)."""
    ptr = cs[0x34]
    out: dict = {}
    seen = 0
    while ptr and seen < 48:
        cap_id, nxt = cs[ptr], cs[ptr + 1]
        if cap_id == 0x10:
            caps = struct.unpack_from("<H", cs, ptr + 2)[0]
            lcap = struct.unpack_from("<I", cs, ptr + 0x0C)[0]
            lsta = struct.unpack_from("<H", cs, ptr + 0x12)[0]
            dcap2 = struct.unpack_from("<I", cs, ptr + 0x24)[0]
            out = {"port_type": (caps >> 4) & 0xF, "max_speed_code": lcap & 0xF,
                   "max_width": (lcap >> 4) & 0x3F, "cur_speed_code": lsta & 0xF,
                   "cur_width": (lsta >> 4) & 0x3F,
                   "atomic_completer": bool(dcap2 & (DEVCAP2_ATOMIC_COMP32 | DEVCAP2_ATOMIC_COMP64 | DEVCAP2_ATOMIC_COMP128))}
        ptr = nxt
        seen += 1
    return out
