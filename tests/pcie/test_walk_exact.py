"""The PCIe walk's pieces, exactly: each parser's edges, every role rule (read from the
config space and inferred without it), every kind of link, the root-bus link, where a
pair meets, and the GPU's own figures (BARs, VRAM, NUMA node, dpm level, atomics notes).
bench/mutation.sh judges hw/pcie.py by tests/pcie; these pin what the broad walk tests
(tests/pcie/test_walk.py) only touch."""

from __future__ import annotations

import pytest

from gpuguard.hw.pcie import (
    _Device,
    _link,
    _pair,
    _role,
    _root_bus_link,
    is_gpu,
    kernel_vram,
    parse_aer,
    parse_dpm_pcie,
    parse_link_speed,
    parse_resource,
    walk,
)
from gpuguard.hw.pcie_config import PcieConfig
from gpuguard.hw.pcie_model import Bar, DpmPcieLevel, GpuPair, KernelVram, PcieLink
from gpuguard.hw.pcie_p2p import Cpu
from gpuguard.hw.sysfs import SysfsRoot

from .conftest import ALL_ATOMICS, GIB, MEM32, MEM64_PREF, MIB, R9700, XTX, resource_text


def dev(bdf="0000:01:00.0", ids=("1000", "c010"), cls="0x060400", cur=(16.0, 16), mx=(16.0, 16), cfg=None) -> _Device:
    return _Device(bdf=bdf, path=f"/sys/devices/pci0000:00/{bdf}", vendor=ids[0], device=ids[1], class_code=cls,
                   driver=None, cur_speed=cur[0], max_speed=mx[0], cur_width=cur[1], max_width=mx[1], config=cfg,
                   aer={}, errors={})


def cfg(port_type: str | None) -> PcieConfig:
    return PcieConfig(size=4096, has_pcie=port_type is not None, port_type=port_type)


def test_link_speed_words():
    assert parse_link_speed("16.0 GT/s PCIe") == 16.0
    assert parse_link_speed("8 GT/s") == 8.0
    assert parse_link_speed("2.5 GT/s PCIe\n") == 2.5
    assert parse_link_speed("32.0GT/s") == 32.0
    assert parse_link_speed("Unknown") is None
    assert parse_link_speed("") is None
    assert parse_link_speed(None) is None
    assert parse_link_speed("fast") is None


def test_aer_total_line_wins_else_the_sum_else_nothing():
    assert parse_aer("RxErr 1\nBadTLP 2\nTOTAL_ERR_COR 7\n") == 7
    assert parse_aer("TOTAL_ERR_FATAL 0\nDLP 5\n") == 0  # a zero total is a total
    assert parse_aer("RxErr 1\nBadTLP 2\n") == 3
    assert parse_aer("RxErr 0\n") == 0
    # Lines that are not `Name count` are passed over, not counted or fatal.
    assert parse_aer("header line here\nRxErr x\nRxErr 4\nA B C\n") == 4
    assert parse_aer("") is None
    assert parse_aer("RxErr -1\n") is None


def test_resource_bars_exactly():
    text = resource_text({0: (0x38000000000, 32 * GIB, MEM64_PREF), 2: (0x38800000000, 2 * MIB, MEM64_PREF),
                          4: (0xE000, 0x100, 0x40101), 5: (0xFB000000, 0x100000, MEM32)})
    # Only lines 0-5 are BARs (the rest: expansion ROM, SR-IOV ...); I/O BAR 4 is not memory.
    assert parse_resource(text) == (
        Bar(0, 32 * GIB, True, True),
        Bar(2, 2 * MIB, True, True),
        Bar(5, 0x100000, False, False),
    )
    rom_line = resource_text({6: (0xFC000000, 0x20000, MEM32)})
    assert parse_resource(rom_line) == ()
    # A BAR that starts at 0 but ends above it is a BAR.
    assert parse_resource(f"0x{0:016x} 0x{0xFFF:016x} 0x{MEM32:016x}\n") == (Bar(0, 0x1000, False, False),)
    with pytest.raises(ValueError) as e:
        parse_resource("0x0 0x0 0x0\n0x1 0x2\n")
    assert str(e.value) == "resource line 1: expected 'start end flags', read '0x1 0x2'"
    with pytest.raises(ValueError):
        parse_resource("0x0 0x0 0x0 0x0\n")
    long_line = "0x" + "f" * 70
    with pytest.raises(ValueError) as e:
        parse_resource(long_line + "\n")
    assert str(e.value) == f"resource line 0: expected 'start end flags', read {long_line[:60]!r}"
    # A zero range is no BAR, whatever its flags say.
    assert parse_resource(f"0x0 0x0 0x{MEM32:x}\n0x1000 0x1fff 0x{MEM32:x}\n") == (Bar(1, 0x1000, False, False),)
    # Prefetchable and 64-bit are those flag bits alone (IORESOURCE_PREFETCH, IORESOURCE_MEM_64).
    assert parse_resource("0x1000 0x1fff 0x201\n0x2000 0x2fff 0x2200\n0x3000 0x3fff 0x100200\n") == (
        Bar(0, 0x1000, False, False), Bar(1, 0x1000, True, False), Bar(2, 0x1000, False, True))


def test_dpm_pcie_active_level():
    assert parse_dpm_pcie("0: 2.5GT/s, x1 78Mhz *\n1: 16.0GT/s, x16 623Mhz \n") == DpmPcieLevel(2.5, 1)
    assert parse_dpm_pcie("0: 8.0GT/s, x16 78Mhz *\n1: 16.0GT/s, x8 623Mhz *\n") == DpmPcieLevel(16.0, 8)
    assert parse_dpm_pcie("0: 2.5GT/s, x1 78Mhz \n") is None
    assert parse_dpm_pcie("garbage *\n") is None


def test_kernel_vram_line_per_gpu():
    lines = [
        "[    4.0] unrelated line first",
        "[    4.1] amdgpu 0000:aa:00.0: amdgpu: Detected VRAM RAM=24560M, BAR=256M",
        "[    4.2] amdgpu 0000:b0:00.0: amdgpu: Detected VRAM RAM=24560M, BAR=32768M",
        "[    4.3] amdgpu 0000:cc:00.0: amdgpu: Detected VRAM RAM=1M, BAR=1M",  # not a GPU walked
        "[    4.4] unrelated line",
    ]
    assert kernel_vram(lines, list(XTX)) == {
        XTX[0]: KernelVram(24560, 256), XTX[1]: KernelVram(24560, 32768)}
    bare = ["[drm] Detected VRAM RAM=16368M, BAR=16384M"]
    assert kernel_vram(bare, [XTX[0]]) == {XTX[0]: KernelVram(16368, 16384)}
    assert kernel_vram(bare, list(XTX)) == {}  # two GPUs: whose figure is it?
    assert kernel_vram(bare, []) == {}


@pytest.mark.parametrize("vendor, cls, driver, gpu", [
    ("1002", "0x030000", "amdgpu", True),
    ("10de", "0x030200", None, True),      # a 3D controller without a driver bound
    ("8086", "0x038000", None, True),
    ("1a03", "0x030000", "ast", False),    # BMC VGA
    ("1af4", "0x030000", "virtio-pci", False),
    ("1af4", "0x030000", "amdgpu", True),  # the driver says so
    ("1002", "0x040300", "snd_hda_intel", False),
    ("1002", None, "amdgpu", False),
    ("1002", "", "amdgpu", False),
])
def test_what_counts_as_a_gpu(vendor, cls, driver, gpu):
    assert is_gpu(vendor, cls, driver) is gpu


@pytest.mark.parametrize("d, position, parent, last, role", [
    # The config space says what each port is.
    (dev(cls="0x030000", cfg=cfg("endpoint")), 3, "card_downstream", True, ("gpu", False)),
    (dev(cls="0x030000", cfg=None), 3, "card_downstream", True, ("gpu", True)),
    (dev(cls="0x030000", cfg=cfg(None)), 0, None, True, ("gpu", True)),
    (dev(cls="0x030000", cfg=cfg("endpoint")), 3, "card_downstream", False, ("endpoint", False)),
    (dev(ids=("1002", "1478"), cfg=cfg("switch_upstream")), 1, "root_port", False, ("card_upstream", False)),
    (dev(ids=("1002", "1479"), cfg=cfg("switch_downstream")), 2, "card_upstream", False, ("card_downstream", False)),
    (dev(ids=("1002", "1478"), cfg=cfg("switch_downstream")), 2, "card_upstream", False, ("switch_downstream", False)),
    (dev(ids=("1002", "1479"), cfg=cfg("switch_upstream")), 1, "root_port", False, ("switch_upstream", False)),
    (dev(cfg=cfg("root_port")), 0, None, False, ("root_port", False)),
    (dev(cfg=cfg("switch_upstream")), 1, "root_port", False, ("switch_upstream", False)),
    (dev(cfg=cfg("switch_downstream")), 2, "switch_upstream", False, ("switch_downstream", False)),
    (dev(cls="0x020000", cfg=cfg("legacy_endpoint")), 1, "root_port", True, ("endpoint", False)),
    (dev(cls="0x020000", cfg=cfg("rc_integrated_endpoint")), 0, None, True, ("endpoint", False)),
    (dev(cfg=cfg("pcie_to_pci_bridge")), 1, "root_port", False, ("bridge", False)),
    # Without it: the card's own switch ids, then the position and the parent's role.
    (dev(ids=("1002", "1478")), 1, "root_port", False, ("card_upstream", True)),
    (dev(ids=("1002", "1479")), 2, "card_upstream", False, ("card_downstream", True)),
    (dev(), 0, None, False, ("root_port", True)),
    (dev(), 0, None, True, ("root_port", True)),          # a bridge, even last
    (dev(cls="0x020000"), 0, None, False, ("root_port", True)),  # not last: something hangs below
    (dev(cls="0x020000"), 0, None, True, ("endpoint", True)),
    (dev(), 1, "root_port", False, ("switch_upstream", True)),
    (dev(), 2, "switch_downstream", False, ("switch_upstream", True)),
    (dev(), 2, "card_downstream", False, ("switch_upstream", True)),
    (dev(), 2, "switch_upstream", False, ("switch_downstream", True)),
    (dev(), 2, "card_upstream", False, ("switch_downstream", True)),
    (dev(), 2, "bridge", False, ("bridge", True)),
    (dev(), 2, None, False, ("bridge", True)),
    (dev(cls="0x020000"), 2, "switch_downstream", False, ("switch_upstream", True)),
    (dev(cls="0x020000"), 2, "switch_downstream", True, ("endpoint", True)),
    (dev(ids=(None, None), cls=None), 2, "switch_downstream", True, ("unknown", True)),
    (dev(ids=("1002", None), cls=None), 2, "switch_downstream", True, ("endpoint", True)),
    (dev(ids=(None, None), cls="0x020000"), 2, "switch_downstream", True, ("endpoint", True)),
])
def test_role_of_each_hop(d, position, parent, last, role):
    assert _role(d, position, parent, last) == role


def test_link_kinds_and_figures():
    rp = dev("0000:00:01.1", ids=("1022", "1483"), cur=(16.0, 16), mx=(16.0, 16))
    up = dev("0000:01:00.0", ids=("1000", "c010"), cur=(5.0, 16), mx=(16.0, 16))
    assert _link(rp, "root_port", up, "switch_upstream") == PcieLink(
        "0000:00:01.1", "0000:01:00.0", "external", 5.0, 16, 16.0, 16, None, True, False)
    # Below an upstream port is the switch's internal bus: no physical link.
    down = dev("0000:02:00.0", ids=("1000", "c010"), cur=(5.0, 16), mx=(16.0, 16))
    assert _link(up, "switch_upstream", down, "switch_downstream") is None
    assert _link(up, "card_upstream", down, "card_downstream") is None
    # Below a GPU or an endpoint: not a port, no link.
    assert _link(up, "gpu", down, "endpoint") is None
    assert _link(up, "endpoint", down, "endpoint") is None
    # INCIDENTS §4: two ports of one switch mirror each other: switch-internal, never downgraded.
    internal_up = dev("0000:03:00.0", ids=("1000", "c010"), cur=(5.0, 16), mx=(16.0, 16))
    assert _link(down, "switch_downstream", internal_up, "switch_upstream") == PcieLink(
        "0000:02:00.0", "0000:03:00.0", "switch_internal", 5.0, 16, 16.0, 16, None, False, False)
    # A different switch below the same kind of port is an external link.
    other = dev("0000:03:00.0", ids=("1000", "c012"), cur=(5.0, 16), mx=(16.0, 16))
    assert _link(down, "switch_downstream", other, "switch_upstream").kind == "external"
    same_vendor_other_device = dev("0000:03:00.0", ids=("1000", "c010"), cur=(5.0, 16), mx=(16.0, 16))
    assert _link(down, "switch_downstream", same_vendor_other_device, "endpoint").kind == "external"
    assert _link(rp, "root_port", dev("0000:01:00.0", ids=("1022", "1483")), "switch_upstream").kind == "external"
    no_ids = dev("0000:02:00.0", ids=(None, None))
    assert _link(no_ids, "switch_downstream", dev("0000:03:00.0", ids=(None, None)), "switch_upstream").kind == (
        "external")
    # Inside the card: the card's downstream port to the GPU.
    gpu = dev("0000:04:00.0", ids=("1002", "744c"), cls="0x030000", cur=(16.0, 16), mx=(16.0, 16))
    assert _link(dev("0000:03:00.0", ids=("1002", "1479")), "card_downstream", gpu, "gpu").kind == "card_internal"
    # Below a plain bridge or an unknown port: an external link.
    assert _link(rp, "bridge", gpu, "gpu").kind == "external"
    assert _link(rp, "unknown", gpu, "gpu").kind == "external"


def test_link_takes_the_childs_status_and_the_lesser_maximum():
    parent = dev("0000:00:01.1", cur=(8.0, 16), mx=(16.0, 16))
    child = dev("0000:01:00.0", cur=(None, None), mx=(32.0, 8))
    lk = _link(parent, "root_port", child, "endpoint")
    assert lk == PcieLink("0000:00:01.1", "0000:01:00.0", "external", 8.0, 16, 16.0, 8, "0000:00:01.1", True, False)
    lk2 = _link(parent, "root_port", dev("0000:01:00.0", cur=(2.5, 4), mx=(16.0, 16)), "endpoint")
    assert (lk2.current_speed_gts, lk2.current_width, lk2.downgraded_speed, lk2.downgraded_width) == (
        2.5, 4, True, True)
    lk3 = _link(parent, "root_port", dev("0000:01:00.0", cur=(16.0, 16), mx=(8.0, 16)), "endpoint")
    assert (lk3.capable_speed_gts, lk3.limited_by, lk3.downgraded) == (8.0, "0000:01:00.0", False)


def test_root_bus_link_is_the_devices_own_registers():
    gpu = dev("0000:00:05.0", ids=("10de", "2335"), cls="0x030200", cur=(16.0, 8), mx=(32.0, 16))
    assert _root_bus_link("pci0000:00", gpu, "gpu") == PcieLink(
        "pci0000:00", "0000:00:05.0", "external", 16.0, 8, 32.0, 16, None, True, True)
    assert _root_bus_link("pci0000:00", gpu, "root_port") is None
    assert _root_bus_link("pci0000:00", dev(cur=(None, None)), "endpoint") is None
    only_speed = _root_bus_link("pci0000:00", dev(cur=(32.0, None), mx=(32.0, None)), "endpoint")
    assert (only_speed.current_speed_gts, only_speed.current_width, only_speed.downgraded) == (32.0, None, False)
    only_width = _root_bus_link("pci0000:00", dev(cur=(None, 16), mx=(None, 16)), "endpoint")
    assert (only_width.current_width, only_width.capable_width, only_width.downgraded) == (16, 16, False)


def test_pairs_meet_exactly_where_their_paths_part(incident):
    rep = walk(SysfsRoot(str(incident.base)), {b: True for b in XTX + R9700})
    xtx, r9700 = rep.gpu(XTX[0]), rep.gpu(R9700[0])
    hbs = dict(rep.host_bridges)
    under_switch = _pair(xtx, rep.gpu(XTX[1]), hbs)
    assert (under_switch.meet, under_switch.at, under_switch.at_ids, under_switch.host_bridge) == (
        "switch", "0000:a1:00.0", "1000:c010", "8086:6f00")
    assert (under_switch.across_root_complexes, under_switch.across_numa_nodes) == (False, False)
    # Same root complex, different root ports: the paths share no hop.
    same_complex = _pair(r9700, rep.gpu(R9700[1]), hbs)
    assert (same_complex.meet, same_complex.at, same_complex.at_ids, same_complex.host_bridge) == (
        "host_bridge", "pci0000:00", "8086:6f00", "8086:6f00")
    across = _pair(r9700, xtx, hbs)
    assert (across.meet, across.at, across.at_ids, across.host_bridge, across.across_root_complexes,
            across.across_numa_nodes) == ("host_bridge", "pci0000:00 / pci0000:a0", None, "8086:6f00", True, False)
    assert [(d.reader, d.owner) for d in across.directions] == [(R9700[0], XTX[0]), (XTX[0], R9700[0])]
    # Unknown host bridges are left out of the ids, not printed as None.
    assert _pair(r9700, xtx, {"pci0000:00": None, "pci0000:a0": "8086:6f00"}).host_bridge == "8086:6f00"
    assert _pair(r9700, xtx, {}).host_bridge is None
    two = _pair(r9700, xtx, {"pci0000:00": "8086:6f01", "pci0000:a0": "1022:14a4"})
    assert two.host_bridge == "1022:14a4 / 8086:6f01"


def test_pair_across_sockets_needs_both_numa_nodes(incident):
    incident.set(R9700[0], "numa_node", "0\n")
    incident.set(XTX[0], "numa_node", "1\n")
    incident.set(XTX[1], "numa_node", "0\n")
    rep = walk(SysfsRoot(str(incident.base)))
    r9700, xtx, xtx2, r9700b = (rep.gpu(b) for b in (R9700[0], XTX[0], XTX[1], R9700[1]))
    assert (r9700.numa_node, xtx.numa_node, r9700b.numa_node) == (0, 1, None)
    assert _pair(r9700, xtx, rep.host_bridges).across_numa_nodes is True
    assert _pair(r9700, xtx2, rep.host_bridges).across_numa_nodes is False  # both node 0
    assert _pair(r9700b, xtx, rep.host_bridges).across_numa_nodes is False  # one node unknown
    assert _pair(xtx, r9700b, rep.host_bridges).across_numa_nodes is False


def test_the_gpus_own_figures(incident):
    incident.set(XTX[0], "numa_node", "1\n")
    rep = walk(SysfsRoot(str(incident.base)), {XTX[0]: True})
    g = rep.gpu(XTX[0])
    assert g.numa_node == 1
    assert rep.gpu(XTX[1]).numa_node is None  # -1: no NUMA affinity
    assert (g.vram_bytes, g.vram_visible_bytes) == (25753026560, 268435456)
    assert g.bars == (Bar(0, 256 * MIB, True, True), Bar(2, 2 * MIB, True, True), Bar(5, 0x100000, False, False))
    assert g.dpm_pcie_active == DpmPcieLevel(16.0, 16)
    assert (g.busy, rep.gpu(XTX[1]).busy) == (True, False)
    assert (g.vendor, g.device, g.class_code, g.driver, g.root_complex) == (
        "1002", "744c", "0x030000", "amdgpu", "pci0000:a0")
    assert g.root_port_atomics is not None and g.root_port_atomics_note is None
    assert dict(g.errors) == {}


def test_the_gpus_figures_when_files_are_bad_or_missing(incident):
    incident.set(XTX[0], "resource", "0x1 0x2\n")
    incident.remove(XTX[0], "mem_info_vram_total")
    incident.remove(XTX[0], "pp_dpm_pcie")
    incident.set(XTX[1], "pp_dpm_pcie", "")
    rep = walk(SysfsRoot(str(incident.base)), vram={XTX[0]: 24 * GIB, XTX[1]: 1})
    g = rep.gpu(XTX[0])
    path = incident.paths[XTX[0]]
    host_path = "/" + str(path.relative_to(incident.base))
    assert dict(g.errors) == {
        "resource": f"{host_path}/resource: resource line 0: expected 'start end flags', read '0x1 0x2'"}
    assert g.bars == ()
    assert g.vram_bytes == 24 * GIB  # from the other source (NVML) when the driver has none
    assert g.dpm_pcie_active is None
    other = rep.gpu(XTX[1])
    assert other.vram_bytes == 25753026560  # the driver's own figure wins
    assert other.dpm_pcie_active is None


def test_root_port_atomics_note_names_why_they_are_unknown(pci_tree):
    t = pci_tree
    t.add("0000:00:00.0", "pci0000:00", "8086:6f00", 0x060000)
    t.add("0000:00:01.0", "pci0000:00", "8086:6f04", 0x060400, port="root_port", cur=(8.0, 16), max=(8.0, 16),
          devcap2=ALL_ATOMICS, config="truncated")
    t.add("0000:01:00.0", "0000:00:01.0", "1002:744c", 0x030000, port="endpoint", cur=(8.0, 16), max=(16.0, 16),
          driver="amdgpu")
    t.add("0000:00:02.0", "pci0000:00", "8086:6f04", 0x060400, port="root_port", cur=(8.0, 16), max=(8.0, 16),
          config="none")
    t.add("0000:02:00.0", "0000:00:02.0", "1002:744c", 0x030000, port="endpoint", driver="amdgpu")
    t.add("0000:00:03.0", "pci0000:00", "8086:6f04", 0x060400, port="root_port", config="garbage")
    t.add("0000:03:00.0", "0000:00:03.0", "1002:744c", 0x030000, port="endpoint", driver="amdgpu")
    t.add("0000:00:05.0", "pci0000:00", "10de:2335", 0x030200, port="endpoint", cur=(16.0, 16), max=(32.0, 16),
          driver="nvidia")
    rep = walk(SysfsRoot(str(t.base)))
    notes = {g.bdf: g.root_port_atomics_note for g in rep.gpus}
    assert notes["0000:01:00.0"] == "unknown (needs root): only 64 bytes of 0000:00:01.0/config are readable"
    assert notes["0000:02:00.0"].startswith("unknown: ")
    assert "0000:00:02.0/config" in notes["0000:02:00.0"]
    assert notes["0000:03:00.0"].startswith("unknown: 0000:00:03.0/config: ")
    assert notes["0000:00:05.0"] == (
        "unknown: no root port above the GPU (it sits on the root bus: passed through "
        "into a VM, or integrated); the real root port is not visible here")
    assert all(g.root_port_atomics is None for g in rep.gpus)
    on_bus = rep.gpu("0000:00:05.0")
    assert on_bus.hops[0].link == PcieLink("pci0000:00", "0000:00:05.0", "external", 16.0, 16, 32.0, 16, None,
                                           True, False)
    assert (on_bus.narrowest, on_bus.slot_link) == (0, 0)


def test_two_gpu_functions_below_one_root_port_meet_at_it(pci_tree):
    t = pci_tree
    t.add("0000:00:00.0", "pci0000:00", "1022:14a4", 0x060000)
    t.add("0000:00:01.1", "pci0000:00", "1022:1483", 0x060400, port="root_port", cur=(16.0, 16), max=(16.0, 16))
    for fn in ("0000:01:00.0", "0000:01:00.1"):
        t.add(fn, "0000:00:01.1", "1002:744c", 0x030000, port="endpoint", cur=(16.0, 16), max=(16.0, 16),
              driver="amdgpu")
    rep = walk(SysfsRoot(str(t.base)))
    p = rep.pair("0000:01:00.0", "0000:01:00.1")
    assert (p.meet, p.at, p.at_ids, p.host_bridge) == ("root_port", "0000:00:01.1", "1022:1483", "1022:14a4")
    assert p.meeting == "meet at root port 0000:00:01.1 (1022:1483)"


def test_both_ends_of_a_downgraded_link_are_marked_and_a_missing_numa_node_is_no_error(pci_tree):
    t = pci_tree
    t.add("0000:00:00.0", "pci0000:00", "1022:14a4", 0x060000)
    t.add("0000:00:01.1", "pci0000:00", "1022:1483", 0x060400, port="root_port", cur=(16.0, 16), max=(16.0, 16))
    t.add("0000:01:00.0", "0000:00:01.1", "1002:744c", 0x030000, port="endpoint", cur=(8.0, 16), max=(16.0, 16),
          driver="amdgpu", files={"resource": resource_text({})})
    t.remove("0000:01:00.0", "numa_node")
    g = walk(SysfsRoot(str(t.base))).gpu("0000:01:00.0")
    assert [(h.bdf, h.downgraded) for h in g.hops] == [("0000:00:01.1", True), ("0000:01:00.0", True)]
    assert g.numa_node is None
    assert dict(g.errors) == {}  # an absent numa_node (no NUMA) is not a read problem


def test_root_port_atomics_note_without_the_capability_or_its_second_registers(pci_tree):
    t = pci_tree
    t.add("0000:00:00.0", "pci0000:00", "8086:6f00", 0x060000)
    t.add("0000:00:01.0", "pci0000:00", "8086:6f04", 0x060400, cur=(8.0, 16), max=(8.0, 16))  # no PCIe capability
    t.add("0000:01:00.0", "0000:00:01.0", "1002:744c", 0x030000, port="endpoint", driver="amdgpu")
    rp2 = t.add("0000:00:02.0", "pci0000:00", "8086:6f04", 0x060400, port="root_port", cur=(8.0, 16),
                max=(8.0, 16), devcap2=ALL_ATOMICS)
    t.add("0000:02:00.0", "0000:00:02.0", "1002:744c", 0x030000, port="endpoint", driver="amdgpu")
    # A version 1 PCIe capability has no Device Capabilities 2 (the atomics bits live there).
    data = bytearray((rp2 / "config").read_bytes())
    data[0x80 + 0x02] = (data[0x80 + 0x02] & 0xF0) | 0x1
    (rp2 / "config").write_bytes(bytes(data))
    rep = walk(SysfsRoot(str(t.base)))
    assert rep.gpu("0000:01:00.0").root_port_atomics_note == "unknown: 0000:00:01.0 has no PCI Express capability"
    assert rep.gpu("0000:02:00.0").root_port_atomics_note == (
        "unknown: 0000:00:02.0 PCIe capability has no Device Capabilities 2")
    assert rep.gpu("0000:01:00.0").root_port_atomics is None
    assert rep.gpu("0000:02:00.0").root_port_atomics is None
