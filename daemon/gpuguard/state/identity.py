"""GPU identity: which configured name a discovered GPU gets. By PCI address, or PCI id
plus order among equal cards (sorted by address) — never by cardN index, which swaps
between boots (INCIDENTS §8). An unnamed GPU, of any vendor, is called by its PCI address
(`0000:05:00.0`): stable across boots, what lspci, nvidia-smi and the kernel print, and not
mistaken for the DRM node `cardN` (the old `card` + address read as `card0` + noise).

Identity fails closed. An index is only meaningful while every card of that id is
present: with the first of two 7900 XTX missing, "index 0" would be the second card, and
its profile would go onto the wrong card (INCIDENTS §2 is the same failure by glob). So a
`{pci_id, index}` entry names a card only while the present count of that id equals the
configured count (`match.count`, else the highest index + 1); otherwise the cards of
that id stay unnamed (nothing is written to them) and each unnamed entry is reported
missing. A card this process already identified at an address keeps its name there
(`known`): that is knowledge, not inference from order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence


class PciIdentity(Protocol):
    bdf: str
    vendor: str
    device_id: str


def default_name(bdf: str) -> str:
    """The name of a GPU no config entry names: its PCI address, for every vendor."""
    return bdf


def pci_id_of(d: PciIdentity) -> str:
    return f"{d.vendor}:{d.device_id}".lower()


@dataclass(frozen=True)
class MissingCard:
    """A configured name with no present card: `match` says how it is looked for
    (`1002:744c #0` or a PCI address), `why` what is known."""

    name: str
    match: str
    why: str

    def label(self) -> str:
        return f"{self.name} ({self.match})"


@dataclass(frozen=True)
class Identity:
    names: Mapping[str, str]  # bdf -> configured name, only for identified cards
    missing: tuple[MissingCard, ...] = ()
    configured: int = 0  # how many cards the config describes
    unnamed_why: Mapping[str, str] = field(default_factory=dict)  # bdf -> why not named

    def name(self, bdf: str) -> str:
        return self.names.get(bdf) or default_name(bdf)


def configured_counts(entries: Iterable) -> dict[str, int]:
    """pci_id -> how many cards of that id the config implies."""
    out: dict[str, int] = {}
    for e in entries:
        m = e.match
        if m.pci_id is None:
            continue
        want = max(m.index + 1, getattr(m, "count", None) or 0)
        out[m.pci_id] = max(out.get(m.pci_id, 0), want)
    return out


def identify(devices: Iterable[PciIdentity], entries: Sequence, known: Mapping[str, str] | None = None) -> Identity:
    """Name the present `devices` from config `entries` (GpuEntry: name, match).
    `known`: bdf -> name bindings this process made earlier for cards still present."""
    devices = sorted(devices, key=lambda d: d.bdf)
    known = dict(known or {})
    present = {d.bdf for d in devices}
    names: dict[str, str] = {}
    missing: list[MissingCard] = []
    unnamed_why: dict[str, str] = {}
    entries = list(entries)
    for e in entries:
        if e.match.bdf is not None:
            if e.match.bdf in present and e.match.bdf not in names:
                names[e.match.bdf] = e.name
            elif e.match.bdf not in present:
                missing.append(MissingCard(e.name, e.match.bdf, "no card at this PCI address"))
    counts = configured_counts(entries)
    for pci_id, want in counts.items():
        group = [e for e in entries if e.match.pci_id == pci_id]
        cards = [d.bdf for d in devices if pci_id_of(d) == pci_id]
        by_order = {e.name: cards[e.match.index] for e in group if len(cards) == want}
        # the order is trusted only when it agrees with every binding already known
        bound_at = {n: b for b, n in known.items() if b in present}
        agrees = bool(by_order) and all(
            known.get(b, n) == n and bound_at.get(n, b) == b for n, b in by_order.items()
        )
        if agrees:
            for n, b in by_order.items():
                if b not in names:
                    names[b] = n
            continue
        held = {n: b for b, n in known.items() if b in cards and any(e.name == n for e in group)}
        for n, b in held.items():
            names.setdefault(b, n)
        before = len(missing)
        for e in group:
            if e.name in held:
                continue
            if len(cards) == want:
                why = (f"the order of the {want} cards with id {pci_id} changed since they were identified; "
                       "which card this is is unknown, so it is not named")
            else:
                why = (f"{len(cards)} of {want} cards with id {pci_id} present; which one is missing is unknown, "
                       "so an index names no card (INCIDENTS §2)")
            missing.append(MissingCard(e.name, f"{pci_id} #{e.match.index}", why))
        for b in cards:
            if b not in names:
                # this group's own reason; another group's (an address not found) says nothing here
                unnamed_why[b] = missing[-1].why if len(missing) > before else "not identified"
    configured = sum(1 for e in entries if e.match.bdf is not None) + sum(counts.values())
    return Identity(names, tuple(missing), configured, unnamed_why)


def assign_names(devices: Iterable[PciIdentity], gpus: Iterable) -> dict[str, str]:
    """bdf -> name for every device (identified cards by their configured name, the rest
    their PCI address). `gpus` are config GpuEntry items (name, match)."""
    devices = list(devices)
    ident = identify(devices, list(gpus))
    return {d.bdf: ident.name(d.bdf) for d in devices}


def missing_names(devices: Iterable[PciIdentity], gpus: Iterable) -> list[str]:
    """Configured names that name no present GPU (a late card, a dead slot, or a card of
    an incomplete `{pci_id, index}` group)."""
    return [m.name for m in identify(list(devices), list(gpus)).missing]
