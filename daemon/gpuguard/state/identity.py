"""GPU identity: which configured name a discovered GPU gets. By PCI address, or PCI id
plus order among equal cards (sorted by address) — never by cardN index, which swaps
between boots (INCIDENTS §8). Unnamed GPUs are called `card` + PCI address."""
from __future__ import annotations

from typing import Iterable, Protocol


class PciIdentity(Protocol):
    bdf: str
    vendor: str
    device_id: str


def default_name(bdf: str) -> str:
    return f"card{bdf}"


def assign_names(devices: Iterable[PciIdentity], gpus: Iterable) -> dict[str, str]:
    """bdf -> name for every device. `gpus` are config GpuEntry items (name, match)."""
    devices = sorted(devices, key=lambda d: d.bdf)
    names: dict[str, str] = {}
    taken: set[str] = set()
    for entry in gpus:
        m = entry.match
        if m.bdf is not None:
            hit = [d for d in devices if d.bdf == m.bdf]
        else:
            same = [d for d in devices if f"{d.vendor}:{d.device_id}".lower() == m.pci_id]
            hit = same[m.index : m.index + 1]
        for d in hit:
            if d.bdf not in names:
                names[d.bdf] = entry.name
                taken.add(entry.name)
    for d in devices:
        names.setdefault(d.bdf, default_name(d.bdf))
    return names


def missing_names(devices: Iterable[PciIdentity], gpus: Iterable) -> list[str]:
    """Configured names that matched no present GPU (a late card, a dead slot)."""
    found = set(assign_names(devices, gpus).values())
    return [g.name for g in gpus if g.name not in found]
