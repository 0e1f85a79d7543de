"""PCI-core sysfs attributes of a simulated function: ids, class, link attributes,
`resource`, `numa_node`, `config`, AER counters, `uevent`.

Formats are the kernel's (drivers/pci/pci-sysfs.c, pcie/aer.c): `0x%04x\n` ids,
`0x%06x\n` class, pci_speed_string() link speeds, `0x%016llx` resource triples (13 lines
for an endpoint, 17 for a bridge), AER `Name count` lines plus a TOTAL line.
"""
from __future__ import annotations

from .pciconfig import config_space
from .topology import PciFunction, speed_str

# aer.c string tables (NULL entries left out, as the show functions skip them).
AER_COR = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
AER_UNCOR = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
             "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP",
             "AtomicOpBlocked", "TLPBlockedErr", "PoisonTLPBlocked")


class AerCounters:
    def __init__(self) -> None:
        self.cor = {n: 0 for n in AER_COR}
        self.nonfatal = {n: 0 for n in AER_UNCOR}
        self.fatal = {n: 0 for n in AER_UNCOR}

    def render(self, which: str) -> bytes:
        table = {"correctable": self.cor, "nonfatal": self.nonfatal, "fatal": self.fatal}[which]
        total = {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL", "fatal": "TOTAL_ERR_FATAL"}[which]
        lines = [f"{k} {v}\n" for k, v in table.items()]
        lines.append(f"{total} {sum(table.values())}\n")
        return "".join(lines).encode()


def resource_text(fn: PciFunction) -> bytes:
    n = 17 if fn.class_code >> 8 == 0x0604 else 13
    rows = [(0, 0, 0)] * n
    for idx, start, size, flags in fn.bars:
        rows[idx] = (start, start + size - 1, flags)
    return "".join(f"0x{s:016x} 0x{e:016x} 0x{f:016x}\n" for s, e, f in rows).encode()


def uevent_text(fn: PciFunction) -> bytes:
    cls = f"{fn.class_code:X}"
    lines = []
    if fn.driver:
        lines.append(f"DRIVER={fn.driver}")
    lines += [f"PCI_CLASS={cls}", f"PCI_ID={fn.vendor:04X}:{fn.device:04X}",
              f"PCI_SUBSYS_ID={fn.subsystem_vendor:04X}:{fn.subsystem_device:04X}",
              f"PCI_SLOT_NAME={fn.bdf}",
              f"MODALIAS=pci:v{fn.vendor:08X}d{fn.device:08X}sv{fn.subsystem_vendor:08X}"
              f"sd{fn.subsystem_device:08X}bc{fn.class_code >> 16:02X}sc{(fn.class_code >> 8) & 0xFF:02X}"
              f"i{fn.class_code & 0xFF:02X}"]
    return ("\n".join(lines) + "\n").encode()


def pci_attributes(fn: PciFunction, aer: AerCounters, dead) -> dict:
    """name → render() for the PCI-core files of `fn`. `dead()` is True while the function
    has fallen off the bus (config reads all ones; link status decodes as 0xffff)."""
    def const(text: str):
        data = text.encode()
        return lambda: data

    attrs = {
        "vendor": const(f"0x{fn.vendor:04x}\n"),
        "device": const(f"0x{fn.device:04x}\n"),
        "subsystem_vendor": const(f"0x{fn.subsystem_vendor:04x}\n"),
        "subsystem_device": const(f"0x{fn.subsystem_device:04x}\n"),
        "class": const(f"0x{fn.class_code:06x}\n"),
        "revision": const(f"0x{fn.revision:02x}\n"),
        "numa_node": const(f"{fn.numa}\n"),
        "resource": lambda: resource_text(fn),
        "uevent": lambda: uevent_text(fn),
        "enable": const("1\n"),
        "config": lambda: config_space(fn, present=not dead()),
    }
    if fn.port_type is not None:
        attrs.update({
            "current_link_speed": lambda: b"Unknown\n" if dead() else speed_str(fn.cur_speed).encode() + b"\n",
            "current_link_width": lambda: b"63\n" if dead() else f"{fn.cur_width}\n".encode(),
            "max_link_speed": const(speed_str(fn.max_speed) + "\n"),
            "max_link_width": const(f"{fn.max_width}\n"),
            "aer_dev_correctable": lambda: aer.render("correctable"),
            "aer_dev_nonfatal": lambda: aer.render("nonfatal"),
            "aer_dev_fatal": lambda: aer.render("fatal"),
        })
    if fn.secondary is not None:
        attrs["secondary_bus_number"] = const(f"{fn.secondary}\n")
        attrs["subordinate_bus_number"] = const(f"{fn.subordinate}\n")
    return attrs
