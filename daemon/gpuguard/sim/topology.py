"""The simulated host's PCI topology: a small declarative description and its enumeration.

Owns: the description types (`HostSpec` → `RootComplex` → `Port` → `Switch` | `Card`),
depth-first bus numbering the way the kernel assigns it, link training (a link runs at
the lower of its two ends unless the description says it trained lower), and the default
host of INCIDENTS §4 with the variants tests need (`incident_spec(...)`).

Sysfs link attributes show each function's own Link Status: a downstream-facing port
(root port, switch downstream port, the card's 1479) shows the link below it, an
upstream-facing function (switch upstream, the card's 1478, the GPU) the link above it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import cards as cards_mod
from .cards import CardModel

SPEEDS = (2.5, 5.0, 8.0, 16.0, 32.0)


def speed_str(gts: float) -> str:
    """The kernel's pci_speed_string(): `8.0 GT/s PCIe`."""
    return f"{gts:.1f} GT/s PCIe"


# -- description --------------------------------------------------------------------

@dataclass(frozen=True)
class Card:
    """A GPU board: its internal 1002:1478 upstream / 1002:1479 downstream bridge pair
    and the GPU. `slot_speed`/`slot_width`: what the slot hop trained at, when lower than
    both ends (INCIDENTS §4: 5.0 GT/s against 16 GT/s capability)."""

    model: CardModel | str = "r9700"
    slot_speed: float | None = None
    slot_width: int | None = None
    present: bool = True           # False: the GPU appears late (SimHost.appear)
    era: str | None = None         # KernelEra name; None: the host's
    name: str | None = None


@dataclass(frozen=True)
class Port:
    """A downstream-facing bridge: CPU/chipset root port or switch downstream port.
    `virtual`: a switch-internal port whose link attributes are mirror values, not a link
    (INCIDENTS §4)."""

    devfn: str                     # "02.0"
    device: int
    vendor: int = 0x8086
    max_speed: float = 8.0
    max_width: int = 16
    child: "Card | Switch | Port | None" = None
    atomics: bool = True           # Device Capabilities 2 AtomicOp completer 32/64/128
    virtual: bool = False
    mirror_speed: float = 5.0
    mirror_width: int = 16
    secondary: int | None = None   # firmware-assigned secondary bus (gaps are legal)
    # buses firmware reserves below an empty hotplug slot (pci=hpbussize): a board hot-added
    # there needs one per bridge level (1478, 1479, GPU: 3); without them the kernel says
    # "No bus number available for hot-added bridge"
    hotplug_buses: int = 0


@dataclass(frozen=True)
class Switch:
    """A PCIe switch: upstream port + downstream ports on its internal bus."""

    device: int = 0xC010
    vendor: int = 0x1000
    max_speed: float = 16.0
    max_width: int = 16
    ports: tuple[Port, ...] = ()


@dataclass(frozen=True)
class RootComplex:
    bus: int
    numa: int
    ports: tuple[Port, ...]
    host_bridge: int = 0x6F00      # Xeon E5 v3/v4 (X99/C610) DMI2 host bridge
    domain: int = 0


@dataclass(frozen=True)
class HostSpec:
    roots: tuple[RootComplex, ...]
    era: str = "6.14"
    # 0x4000 (PP_OVERDRIVE_MASK) set, as the incident host booted with
    # amdgpu.ppfeaturemask=0xfff7ffff; the kernel default 0xfff7bfff has it clear.
    ppfeaturemask: int = 0xFFF7FFFF
    card_order: tuple[str, ...] | None = None   # bdfs in cardN order (probe order)
    hwmon_order: tuple[str, ...] | None = None  # bdfs in hwmonN order
    first_card: int = 1            # card0 is usually simpledrm/efifb on these hosts
    cpu_hwmons: int = 2            # coretemp per socket, enumerated before the GPUs


# -- enumeration --------------------------------------------------------------------

@dataclass
class PciFunction:
    """One enumerated PCI function with everything sysfs and config space need."""

    bdf: str
    kind: str                      # host_bridge root_port switch_up switch_down card_up card_down gpu
    vendor: int
    device: int
    class_code: int
    revision: int
    subsystem_vendor: int
    subsystem_device: int
    parent: str | None
    numa: int
    path: str                      # /sys/devices/pci0000:00/0000:00:02.0/...
    port_type: int | None          # PCIe Capabilities device/port type; None: no PCIe cap
    max_speed: float = 0.0
    max_width: int = 0
    cur_speed: float = 0.0
    cur_width: int = 0
    atomics: bool = False
    virtual: bool = False
    secondary: int | None = None
    subordinate: int | None = None
    card: Card | None = None
    model: CardModel | None = None
    driver: str | None = None
    bars: list = field(default_factory=list)   # [(index, start, size, flags)]

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"


def bdf_of(domain: int, bus: int, devfn: str) -> str:
    return f"{domain:04x}:{bus:02x}:{devfn}"


def resolve_model(m: CardModel | str) -> CardModel:
    return m if isinstance(m, CardModel) else cards_mod.MODELS[m]


class _Enumerator:
    def __init__(self) -> None:
        self.functions: list[PciFunction] = []
        self.gpu_index = 0

    def add(self, fn: PciFunction) -> PciFunction:
        self.functions.append(fn)
        return fn

    def enumerate(self, spec: HostSpec) -> list[PciFunction]:
        for rc in spec.roots:
            root_path = f"/sys/devices/pci{rc.domain:04x}:{rc.bus:02x}"
            self.add(PciFunction(
                bdf=bdf_of(rc.domain, rc.bus, "00.0"), kind="host_bridge", vendor=0x8086,
                device=rc.host_bridge, class_code=0x060000, revision=0x01,
                subsystem_vendor=0x8086, subsystem_device=0x0000, parent=None, numa=rc.numa,
                path=f"{root_path}/{bdf_of(rc.domain, rc.bus, '00.0')}", port_type=None))
            next_bus = rc.bus + 1
            for port in sorted(rc.ports, key=lambda p: p.devfn):
                next_bus = self.port(port, rc, rc.bus, root_path, None, next_bus, "root_port", None)
        return self.functions

    def port(self, port: Port, rc: RootComplex, bus: int, parent_path: str, parent: str | None,
             next_bus: int, kind: str, upstream_speed: tuple | None) -> int:
        bdf = bdf_of(rc.domain, bus, port.devfn)
        path = f"{parent_path}/{bdf}"
        sec = port.secondary if port.secondary is not None else next_bus
        fn = self.add(PciFunction(
            bdf=bdf, kind=kind, vendor=port.vendor, device=port.device, class_code=0x060400,
            revision=0x01 if port.vendor == 0x8086 else 0xB0,
            subsystem_vendor=port.vendor, subsystem_device=0x0000, parent=parent, numa=rc.numa,
            path=path, port_type=4 if kind == "root_port" else 6, max_speed=port.max_speed,
            max_width=port.max_width, atomics=port.atomics, virtual=port.virtual,
            secondary=sec, driver="pcieport"))
        next_bus = sec + 1
        child = port.child
        if port.virtual:
            fn.max_speed = fn.cur_speed = port.mirror_speed
            fn.max_width = fn.cur_width = port.mirror_width
        if isinstance(child, Card):
            next_bus = self.card(child, rc, sec, path, fn, next_bus)
        elif isinstance(child, Switch):
            next_bus = self.switch(child, rc, sec, path, fn, next_bus)
        elif isinstance(child, Port):
            # A downstream port directly below a switch-internal virtual port (PEX88096).
            next_bus = self.port(child, rc, sec, path, bdf, next_bus, "switch_down", None)
        next_bus = max(next_bus, sec + port.hotplug_buses)
        fn.subordinate = next_bus - 1
        return next_bus

    def _train(self, port_fn: PciFunction, up_speed: float, up_width: int,
               forced_speed: float | None, forced_width: int | None) -> tuple[float, int]:
        speed = forced_speed if forced_speed else min(port_fn.max_speed, up_speed)
        width = forced_width if forced_width else min(port_fn.max_width, up_width)
        if not port_fn.virtual:
            port_fn.cur_speed, port_fn.cur_width = speed, width
        return speed, width

    def switch(self, sw: Switch, rc: RootComplex, bus: int, parent_path: str, port_fn: PciFunction,
               next_bus: int) -> int:
        bdf = bdf_of(rc.domain, bus, "00.0")
        speed, width = self._train(port_fn, sw.max_speed, sw.max_width, None, None)
        path = f"{parent_path}/{bdf}"
        sec = next_bus
        fn = self.add(PciFunction(
            bdf=bdf, kind="switch_up", vendor=sw.vendor, device=sw.device, class_code=0x060400,
            revision=0xB0, subsystem_vendor=sw.vendor, subsystem_device=0xA064,
            parent=port_fn.bdf, numa=rc.numa, path=path, port_type=5, max_speed=sw.max_speed,
            max_width=sw.max_width, cur_speed=speed, cur_width=width, secondary=sec,
            driver="pcieport"))
        next_bus = sec + 1
        for p in sorted(sw.ports, key=lambda p: p.devfn):
            p = replace(p, vendor=sw.vendor, device=sw.device) if p.vendor == 0x8086 else p
            next_bus = self.port(p, rc, sec, path, bdf, next_bus, "switch_down", None)
        fn.subordinate = next_bus - 1
        return next_bus

    def card(self, card: Card, rc: RootComplex, bus: int, parent_path: str, port_fn: PciFunction,
             next_bus: int) -> int:
        model = resolve_model(card.model)
        cap = float(model.link_gen.split()[0])
        internal = float(model.internal_link.split()[0])
        speed, width = self._train(port_fn, cap, 16, card.slot_speed, card.slot_width)
        up_bdf = bdf_of(rc.domain, bus, "00.0")
        up_path = f"{parent_path}/{up_bdf}"
        bus_down, bus_gpu = next_bus, next_bus + 1
        down_bdf = bdf_of(rc.domain, bus_down, "00.0")
        gpu_bdf = bdf_of(rc.domain, bus_gpu, "00.0")
        common = dict(numa=rc.numa, card=card, model=model)
        self.add(PciFunction(
            bdf=up_bdf, kind="card_up", vendor=0x1002, device=0x1478, class_code=0x060400,
            revision=0x10 if model.od_family == "smu13" else 0x24, subsystem_vendor=0x0000,
            subsystem_device=0x0000, parent=port_fn.bdf, path=up_path, port_type=5,
            max_speed=cap, max_width=16, cur_speed=speed, cur_width=width, secondary=bus_down,
            subordinate=bus_gpu, driver="pcieport", atomics=True, **common))
        self.add(PciFunction(
            bdf=down_bdf, kind="card_down", vendor=0x1002, device=0x1479, class_code=0x060400,
            revision=0x10 if model.od_family == "smu13" else 0x24, subsystem_vendor=0x0000,
            subsystem_device=0x0000, parent=up_bdf, path=f"{up_path}/{down_bdf}", port_type=6,
            max_speed=internal, max_width=16, cur_speed=internal, cur_width=16,
            secondary=bus_gpu, subordinate=bus_gpu, driver="pcieport", atomics=True, **common))
        i = self.gpu_index
        self.gpu_index += 1
        # 64-bit prefetchable window above 4 GiB per GPU (64 GiB apart, so a 32 GiB BAR0
        # stays naturally aligned), plus doorbell, IO and register BARs like amdgpu dGPUs.
        base = 0x3800_0000_0000 + (rc.numa << 44) + i * (64 << 30)
        bars = [(0, base, model.bar0_size, 0x14220C),
                (2, base + (32 << 30), 2 << 20, 0x14220C),
                (4, 0x3000 + i * 0x100, 0x100, 0x40101),
                (5, 0xC000_0000 + i * 0x100000, 0x80000, 0x40200),
                (6, 0xC000_0000 + i * 0x100000 + 0x80000, 0x20000, 0x46200)]
        self.add(PciFunction(
            bdf=gpu_bdf, kind="gpu", vendor=0x1002, device=model.device_id, class_code=0x030000,
            revision=model.revision, subsystem_vendor=model.subsystem_vendor,
            subsystem_device=model.subsystem_device, parent=down_bdf,
            path=f"{up_path}/{down_bdf}/{gpu_bdf}", port_type=0, max_speed=internal,
            max_width=16, cur_speed=internal, cur_width=16, driver="amdgpu", bars=bars,
            atomics=False, **common))
        return next_bus + 2


def enumerate_host(spec: HostSpec) -> list[PciFunction]:
    """All PCI functions of the host, depth-first, with buses assigned."""
    return _Enumerator().enumerate(spec)


# -- the incident host and its variants ---------------------------------------------

SPARE_SLOT = "0000:00:03.2"  # incident_spec(spare_slot=True): an empty root port

def _pex88096(xtx_a: Card, xtx_b: Card, slot_width: int = 16) -> Switch:
    """INCIDENTS §4: PEX88096 with internal virtual ports a2:00-08; a2:04.0 and a2:08.0
    lead to the slot downstream ports a7:00.0 / ad:00.0."""
    def slot(card: Card) -> Port:
        return Port("00.0", 0xC010, 0x1000, max_speed=16.0, max_width=slot_width, child=card)
    internal = [Port(f"{d:02x}.0", 0xC010, 0x1000, max_speed=16.0, virtual=True) for d in (0, 1, 2, 3, 5, 6)]
    internal += [Port("04.0", 0xC010, 0x1000, virtual=True, child=slot(xtx_a)),
                 Port("08.0", 0xC010, 0x1000, virtual=True, child=slot(xtx_b))]
    return Switch(ports=tuple(sorted(internal, key=lambda p: p.devfn)))


def incident_spec(*, era: str = "6.14", od_enabled: bool = True, extra_gpus: int = 0,
                  extra_model: str = "r9700", xtx_slot_width: int = 16,
                  xtx_slot_speed: float | None = 5.0, chipset_gpu: bool = False,
                  late: tuple[str, ...] = (), xtx: bool = True, r9700: bool = True,
                  spare_slot: bool = False) -> HostSpec:
    """The dual-socket Xeon host of INCIDENTS §4 and its variants.

    `late`: bdfs of GPUs absent at start (appear with SimHost.appear). `xtx_slot_width=8`:
    the XTX pair in x8 slots. `chipset_gpu`: one more R9700 on a PCH x4 root port without
    AtomicOps completer support (INCIDENTS §6). `extra_gpus`: more GPUs on further root
    ports (the 32-GPU benchmark). `xtx=False`/`r9700=False`: drop that pair. `spare_slot`: an
    empty CPU x16 slot (root port 00:03.2, buses 40-42 reserved for hotplug) a lost card can
    come back in (`SimHost.return_gpu(bdf, slot=SPARE_SLOT)`): the same card at 0000:42:00.0."""
    def card(model: str, bdf: str, **kw) -> Card:
        return Card(model=model, present=bdf not in late, **kw)

    ports0 = [Port("01.0", 0x6F02), Port("01.1", 0x6F03)]
    if r9700:
        ports0 += [Port("02.0", 0x6F04, child=card("r9700", "0000:05:00.0")),
                   Port("03.0", 0x6F08, child=card("r9700", "0000:08:00.0"))]
    extra_a0: list[Port] = []
    for k in range(extra_gpus):
        if k < 24:
            ports0.append(Port(f"{0x04 + k:02x}.0", 0x6F06, child=Card(model=extra_model)))
        else:
            extra_a0.append(Port(f"{0x03 + k - 24:02x}.0", 0x6F06, child=Card(model=extra_model)))
    if spare_slot:
        # after every other CPU port's buses, so no other card's address moves
        ports0.append(Port(SPARE_SLOT.rsplit(":", 1)[1], 0x6F0A, secondary=0x40, hotplug_buses=3))
    if chipset_gpu:
        ports0.append(Port("1c.0", 0x8D10, max_speed=5.0, max_width=4, atomics=False,
                           child=Card(model="r9700")))
    ports_a0 = list(extra_a0)
    if xtx:
        sw = _pex88096(card("xtx", "0000:aa:00.0", slot_speed=xtx_slot_speed),
                       card("xtx", "0000:b0:00.0", slot_speed=xtx_slot_speed), xtx_slot_width)
        ports_a0.append(Port("02.0", 0x6F04, child=sw))
    roots = [RootComplex(bus=0x00, numa=0, ports=tuple(ports0))]
    if ports_a0:
        roots.append(RootComplex(bus=0xA0, numa=1, ports=tuple(ports_a0)))
    order = None
    hw_order = None
    if xtx and r9700 and not extra_gpus and not chipset_gpu:
        # INCIDENTS §8: indices are probe order, not PCI order, and differ between classes.
        order = ("0000:aa:00.0", "0000:05:00.0", "0000:b0:00.0", "0000:08:00.0")
        hw_order = ("0000:08:00.0", "0000:b0:00.0", "0000:05:00.0", "0000:aa:00.0")
    return HostSpec(roots=tuple(roots), era=era,
                    ppfeaturemask=0xFFF7FFFF if od_enabled else 0xFFF7BFFF,
                    card_order=order, hwmon_order=hw_order)


def single_gpu_spec(model: CardModel | str, gpu_bus: int = 0x03, era: str = "6.14",
                    root_speed: float = 16.0, root_width: int = 16, atomics: bool = True) -> HostSpec:
    """One card whose GPU sits at 0000:<gpu_bus>:00.0 behind root port 00:01.0 — the shape
    of a reference dump (tests put a card into a dump's exact state this way)."""
    port = Port("01.0", 0x6F02, max_speed=root_speed, max_width=root_width, atomics=atomics,
                secondary=gpu_bus - 2, child=Card(model=model))
    return HostSpec(roots=(RootComplex(bus=0, numa=0, ports=(port,)),), era=era)
