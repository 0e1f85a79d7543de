"""PCI addresses, in one place: what a bus/device/function address looks like, how a user's
spelling (`05:00.0`, `0000:05:00.0`, upper case) becomes the canonical `0000:05:00.0`, how
addresses are found in kernel log lines (`PCI:0000:3b:00` from NVRM included) and in sysfs
device paths. Standard library only (the PCIe capture must run on a bare GPU host).
GPUs are picked by PCI address, never by index (INCIDENTS §8)."""
from __future__ import annotations

import re

# `dddd:bb:dd.f`. The domain is 4 hex digits or more: sysfs prints `%04x`, so a VMD domain
# reads `10000:e1:00.0`. A device number is 0..0x1f, a function 0..7 (PCI's 5 and 3 bits).
_DOMAIN = "[0-9a-f]{4,}"
_DEVICE = "[01][0-9a-f]"
BDF_PATTERN = rf"{_DOMAIN}:[0-9a-f]{{2}}:{_DEVICE}\.[0-7]"
CANONICAL_RE = re.compile(rf"^{BDF_PATTERN}$")  # a sysfs device name, exactly as the kernel writes it
# Loose on purpose: a device or function out of range gets its own error, not "not an address".
_USER_RE = re.compile(r"^(?:([0-9a-f]+):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-9])$")
PCI_ID_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{4}$")  # vendor:device, 1002:744c
_IN_PATH_RE = re.compile(rf"/({BDF_PATTERN})(?=/|$)", re.I)
# A root bus in a sysfs device path: `pci0000:00`, `pci10000:e0` behind VMD.
ROOT_BUS_RE = re.compile(rf"^pci({_DOMAIN}):([0-9a-f]{{2}})$")

_HEX = "[0-9A-Fa-f]"
# In free text: `dddd:bb:dd.f` with an optional domain; NVRM writes `PCI:dddd:bb:dd` (no function).
_ADDRESS_RE = re.compile(
    rf"(?P<nvrm>[Pp][Cc][Ii]:(?P<n_dom>{_HEX}{{4,}}):(?P<n_bus>{_HEX}{{2}}):(?P<n_dev>[01]{_HEX})(?:\.(?P<n_fn>[0-7]))?)"
    rf"|(?<![0-9A-Za-z:])(?:(?P<dom>{_HEX}{{4,}}):)?(?P<bus>{_HEX}{{2}}):(?P<dev>[01]{_HEX})\.(?P<fn>[0-7])(?![0-9A-Za-z])"
)


def _domain(digits: str | None) -> str:
    """`00000000` (NVML) and `0000` (sysfs) are one domain: sysfs's `%04x` spelling."""
    return f"{int(digits, 16):04x}" if digits else "0000"


def is_canonical(name: str) -> bool:
    """Whether `name` is a full lower-case address (`0000:05:00.0`), as sysfs names devices."""
    return bool(CANONICAL_RE.match(name))


def parse_bdf(value: str) -> str:
    """A user's address (`05:00.0`, `0000:AA:00.0`, surrounding blanks) → `0000:05:00.0`.
    Raises ValueError naming the value otherwise."""
    v = str(value).strip().lower()
    m = _USER_RE.match(v)
    if not m:
        raise ValueError(f"{value!r} is not a PCI address like 0000:05:00.0")
    dom, bus, dev, fn = m.groups()
    if dom is not None and len(dom) < 4:
        raise ValueError(f"{value!r} is not a PCI address like 0000:05:00.0: the domain has 4 hex digits or more")
    if int(dev, 16) > 0x1F:
        raise ValueError(f"{value!r} is not a PCI address like 0000:05:00.0: device {dev} is above 1f (0..1f)")
    if int(fn) > 7:
        raise ValueError(f"{value!r} is not a PCI address like 0000:05:00.0: function {fn} is above 7 (0..7)")
    return f"{_domain(dom)}:{bus}:{dev}.{fn}"


def normalise_bus_id(bus_id: str | bytes) -> str:
    """NVML's `00000000:19:00.0` (an 8-digit domain, bytes from older bindings) → sysfs's
    `0000:19:00.0`."""
    return parse_bdf(bus_id.decode() if isinstance(bus_id, bytes) else bus_id)


def parse_pci_id(value: str) -> str:
    v = str(value).strip().lower()
    if not PCI_ID_RE.match(v):
        raise ValueError(f"{value!r} is not a PCI id like 1002:744c")
    return v


def addresses_in(text: str) -> list[str]:
    """Every PCI address in `text`, normalised, first occurrence first, without repeats.
    AER lines name the reporting port first and the erring device second."""
    out: list[str] = []
    for m in _ADDRESS_RE.finditer(text):
        if m.group("nvrm"):
            bdf = f"{_domain(m['n_dom'])}:{m['n_bus']}:{m['n_dev']}.{m['n_fn'] or '0'}"
        else:
            bdf = f"{_domain(m['dom'])}:{m['bus']}:{m['dev']}.{m['fn']}"
        bdf = bdf.lower()
        if bdf not in out:
            out.append(bdf)
    return out


def normalise_bdf(address: str) -> str | None:
    """`0000:3B:00.0`, `3b:00.0`, `PCI:0000:3b:00`, `+pci:0000:3b:00.0` → `0000:3b:00.0`;
    None when `address` holds no PCI address."""
    found = addresses_in(address)
    return found[0] if found else None


def bdf_in_path(devpath: str) -> str | None:
    """The deepest PCI address of a sysfs/udev device path (the device itself, not its bridges)."""
    found = _IN_PATH_RE.findall(devpath)
    return found[-1].lower() if found else None


def host_bridge(root_bus: str) -> str | None:
    """A root bus's host bridge: `pci0000:00` → `0000:00:00.0` (None: not a root bus)."""
    m = ROOT_BUS_RE.match(root_bus)
    return f"{m.group(1)}:{m.group(2)}:00.0" if m else None


def short_bdf(bdf: str) -> str:
    return bdf[5:] if bdf.startswith("0000:") else bdf
