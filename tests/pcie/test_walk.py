"""The walker on the INCIDENTS §4 host and on broken trees: the must-shows of issue 3."""
from __future__ import annotations

import os

import pytest

from gpuguard.document import document
from gpuguard.hw.pcie import parse_aer, parse_dpm_pcie, parse_link_speed, parse_resource, walk
from gpuguard.hw.pcie_model import DpmPcieLevel, KernelVram
from gpuguard.hw.pcie_verdict import link_bytes_per_second
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.sinks.pcie_metrics import samples

XTX = ("0000:aa:00.0", "0000:b0:00.0")
R9700 = ("0000:05:00.0", "0000:08:00.0")
SLOT = {"0000:aa:00.0": ("0000:a7:00.0", "0000:a8:00.0"), "0000:b0:00.0": ("0000:ad:00.0", "0000:ae:00.0")}
ROOT_PORT = {"0000:05:00.0": "0000:00:02.0", "0000:08:00.0": "0000:00:03.0"}
BUSY = {b: True for b in XTX + R9700}


def report_of(tree, busy=BUSY, **kw):
    return walk(SysfsRoot(str(tree.base)), busy, **kw)


def test_link_arithmetic():
    assert parse_link_speed("16.0 GT/s PCIe") == 16.0
    assert parse_link_speed("2.5 GT/s PCIe") == 2.5
    assert parse_link_speed("8 GT/s") == 8.0  # kernels before 4.19 printed no decimals
    assert parse_link_speed("Unknown") is None
    assert parse_link_speed("") is None
    # 8b/10b below 8 GT/s, 128b/130b from 8 GT/s, FLIT at 64 GT/s.
    assert link_bytes_per_second(5.0, 16) == pytest.approx(8.0e9)
    assert link_bytes_per_second(2.5, 1) == pytest.approx(250e6)
    assert link_bytes_per_second(8.0, 16) == pytest.approx(15.754e9, rel=1e-3)
    assert link_bytes_per_second(16.0, 16) == pytest.approx(31.508e9, rel=1e-3)
    assert link_bytes_per_second(64.0, 16) == pytest.approx(121.0e9, rel=1e-3)
    assert link_bytes_per_second(None, 16) is None
    assert link_bytes_per_second(16.0, None) is None


def test_xtx_slot_hop_is_the_narrowest_downgraded_hop_not_the_switch_internal_ports(incident):
    rep = report_of(incident)
    for bdf in XTX:
        g = rep.gpu(bdf)
        assert [h.role for h in g.hops] == [
            "root_port", "switch_upstream", "switch_downstream", "switch_upstream",
            "switch_downstream", "card_upstream", "card_downstream", "gpu",
        ]
        link = g.narrowest_link
        assert (link.upper, link.lower) == SLOT[bdf]
        assert link.kind == "external"
        assert (link.current_speed_gts, link.current_width) == (5.0, 16)
        assert (link.capable_speed_gts, link.capable_width) == (16.0, 16)
        assert link.downgraded_speed and not link.downgraded_width
        assert g.bottleneck_bytes_per_second == pytest.approx(8.0e9)  # Gen2 x16 ceiling
        assert g.slot == link
        # The switch's internal ports mirror 5 GT/s: never downgraded, never narrowest.
        internal = [h for h in g.hops if h.link and h.link.kind == "switch_internal"]
        assert [h.bdf for h in internal] == [g.hops[3].bdf]
        assert not internal[0].link.downgraded and not internal[0].downgraded
        downgraded = {h.bdf for h in g.hops if h.downgraded}
        assert downgraded == set(SLOT[bdf])  # both ends of the slot link, nothing else


def test_mirror_values_lower_than_the_slot_are_still_not_blamed(build_incident):
    rep = report_of(build_incident(mirror_speed=2.5))
    for bdf in XTX:
        assert rep.gpu(bdf).narrowest_link.lower == SLOT[bdf][1]


def test_r9700_paths_are_gen3_x16_limited_at_the_root_port(incident):
    rep = report_of(incident)
    for bdf in R9700:
        g = rep.gpu(bdf)
        assert [h.role for h in g.hops] == ["root_port", "card_upstream", "card_downstream", "gpu"]
        link = g.narrowest_link
        assert link.upper == ROOT_PORT[bdf]
        assert (link.current_speed_gts, link.current_width) == (8.0, 16)
        assert link.limited_by == ROOT_PORT[bdf]
        assert not link.downgraded
        assert g.bottleneck_bytes_per_second == pytest.approx(15.754e9, rel=1e-3)
        # The GPU function's own link is card-internal Gen4: not the slot.
        assert g.hops[-1].link.kind == "card_internal"
        assert g.hops[-1].current_speed_gts == 16.0
        assert g.slot.upper == ROOT_PORT[bdf]


def test_pairs_meet_under_the_switch_or_at_host_bridge_8086_6f00(incident):
    rep = report_of(incident)
    assert len(rep.pairs) == 6
    xtx = rep.pair(*XTX)
    assert xtx.meet == "switch" and xtx.at == "0000:a1:00.0" and xtx.at_ids == "1000:c010"
    # INCIDENTS §5: their 256 MiB BARs keep amdgpu's peers out of each card's VRAM.
    assert xtx.p2p == "no" and "small BAR" in xtx.verdict and "256 MiB" in xtx.verdict
    r = rep.pair(*R9700)
    assert r.meet == "host_bridge" and r.host_bridge == "8086:6f00" and not r.across_root_complexes
    assert r.p2p == "no" and "chipset refuses P2P" in r.verdict
    for a in R9700:
        for b in XTX:
            p = rep.pair(a, b)
            assert p.meet == "host_bridge" and p.host_bridge == "8086:6f00"
            assert p.across_root_complexes and p.p2p == "no"
            assert "chipset refuses P2P" in p.verdict
    assert rep.host_bridges == {"pci0000:00": "8086:6f00", "pci0000:a0": "8086:6f00"}


def test_xtx_in_an_x8_slot_shows_x8_and_half_the_bandwidth(build_incident):
    x16 = report_of(build_incident()).gpu(XTX[0])
    x8 = report_of(build_incident(xtx_slot_width=8, xtx_slot_max_width=8)).gpu(XTX[0])
    link = x8.narrowest_link
    assert (link.upper, link.lower) == SLOT[XTX[0]]
    assert link.current_width == 8 and link.capable_width == 8
    assert not link.downgraded_width  # the slot is x8: nothing lost, just narrow
    assert x8.bottleneck_bytes_per_second == pytest.approx(x16.bottleneck_bytes_per_second / 2)
    assert x8.bottleneck_bytes_per_second == pytest.approx(4.0e9)


def test_lost_lanes_are_downgraded_width(build_incident):
    # x16 slot, x16 card, trained x8: a lost lane.
    g = report_of(build_incident(xtx_slot_width=8)).gpu(XTX[0])
    assert g.narrowest_link.downgraded_width


def test_256mb_bar_on_24gib_card_is_large_bar_not_active(incident):
    rep = report_of(incident)
    xtx = rep.gpu(XTX[0])
    assert xtx.bars[0].index == 0 and xtx.bars[0].size_bytes == 256 << 20
    assert xtx.bars[0].prefetchable and xtx.bars[0].is_64bit
    assert [b.index for b in xtx.bars] == [0, 2, 5]  # BAR4 is I/O, not memory
    assert xtx.large_bar is False
    assert "large BAR not active" in xtx.large_bar_note and "24 GiB" in xtx.large_bar_note
    r = rep.gpu(R9700[0])
    assert r.large_bar is True and r.bars[0].size_bytes == 32 << 30


def test_kernel_detected_vram_line_when_mem_info_is_missing(incident):
    for bdf in XTX:
        incident.remove(bdf, "mem_info_vis_vram_total")
    lines = ["[    4.1] amdgpu 0000:aa:00.0: amdgpu: Detected VRAM RAM=24560M, BAR=256M",
             "[    4.2] amdgpu 0000:05:00.0: amdgpu: Detected VRAM RAM=32624M, BAR=32768M"]
    rep = report_of(incident, kernel_lines=lines)
    assert rep.gpu(XTX[0]).kernel_vram == KernelVram(24560, 256)
    assert rep.gpu(XTX[0]).large_bar is False
    assert "BAR=256M" in rep.gpu(XTX[0]).large_bar_note
    # No kernel figure for the other: VRAM size against its largest BAR.
    assert rep.gpu(XTX[1]).large_bar is False
    assert rep.gpu(XTX[1]).large_bar_note == "large BAR not active: BAR0 256 MiB for 24 GiB VRAM"
    assert rep.gpu(R9700[0]).kernel_vram == KernelVram(32624, 32768)


def test_atomics_read_from_the_root_port_config_space(build_incident):
    rep = report_of(build_incident())
    a = rep.gpu(XTX[0]).root_port_atomics
    assert a.completer32 and a.completer64 and a.completer128_cas and a.routing
    # INCIDENTS §6: a chipset port with every completer bit off.
    rep = report_of(build_incident(root_devcap2=0x040))
    a = rep.gpu(R9700[0]).root_port_atomics
    assert a.routing and not a.completer32 and not a.completer64
    assert a.describe() == "Routing+ 32bit- 64bit- 128bitCAS-"


def test_unprivileged_config_says_needs_root_and_roles_are_inferred(build_incident):
    rep = report_of(build_incident(config="truncated"))
    g = rep.gpu(XTX[0])
    assert g.root_port_atomics is None
    assert g.root_port_atomics_note.startswith("unknown (needs root)")
    # Roles from position and ids, marked inferred, still the same path.
    assert [h.role for h in g.hops] == [
        "root_port", "switch_upstream", "switch_downstream", "switch_upstream",
        "switch_downstream", "card_upstream", "card_downstream", "gpu",
    ]
    assert all(h.role_inferred for h in g.hops)
    assert g.narrowest_link.lower == SLOT[XTX[0]][1]


def test_garbage_capability_list_is_unknown_not_a_crash(build_incident):
    rep = report_of(build_incident(config="garbage"))
    g = rep.gpu(XTX[0])
    assert g.root_port_atomics is None
    assert "loops" in g.root_port_atomics_note


def test_missing_and_unknown_attributes_are_unknown_never_zero(incident):
    # A bridge that says "Unknown" (real on NVIDIA hosts), a GPU without link files,
    # an unreadable resource and a garbage width.
    incident.set("0000:a8:00.0", "current_link_speed", "Unknown\n")
    for name in ("current_link_speed", "max_link_speed", "current_link_width", "max_link_width", "config"):
        incident.remove("0000:05:00.0", name)
    incident.set("0000:05:00.0", "resource", "garbage\n")
    incident.set("0000:03:00.0", "current_link_width", "wide\n")
    os.remove(incident.paths["0000:03:00.0"] / "config")
    rep = report_of(incident)
    gpu = rep.gpu("0000:05:00.0")
    assert gpu.hops[-1].current_speed_gts is None and gpu.hops[-1].max_width is None
    assert gpu.hops[-1].role == "gpu"
    assert "resource" in gpu.errors and gpu.bars == ()
    assert "current_link_width" in gpu.hops[1].errors
    assert gpu.hops[1].current_width is None
    # The slot hop of the first XTX: the switch end still says 5 GT/s.
    xtx = rep.gpu(XTX[0])
    assert xtx.narrowest_link.current_speed_gts == 5.0
    d = document(rep)
    assert d["gpus"][0]["hops"][-1]["current_speed_gts"] is None


def test_non_gpu_displays_are_not_gpus(incident):
    rep = report_of(incident)
    # The BMC's ASPEED VGA (class 0x0300) is not a GPU; the HDMI audio function neither.
    assert sorted(g.bdf for g in rep.gpus) == sorted(R9700 + XTX)


def test_device_without_ids_is_unknown(pci_tree):
    t = pci_tree
    t.add("0000:00:00.0", "pci0000:00", "8086:1234", 0x060000)
    t.add("0000:00:01.0", "pci0000:00", "ffff:ffff", 0x060400, config="none")
    t.remove("0000:00:01.0", "vendor")
    t.remove("0000:00:01.0", "class")
    t.add("0000:01:00.0", "0000:00:01.0", "10de:2335", 0x030200, driver="nvidia", config="none",
          cur=(16.0, 16), max=(32.0, 16))
    rep = walk(SysfsRoot(str(t.base)))
    g = rep.gpu("0000:01:00.0")
    assert g.hops[0].vendor is None and g.hops[0].role == "root_port" and g.hops[0].role_inferred
    assert "vendor" in g.hops[0].errors
    assert g.hops[1].role == "gpu"
    # NVIDIA: no mem_info_*: large BAR unknown, not guessed.
    assert g.large_bar is None and "unknown" in g.large_bar_note


def test_gpu_that_vanishes_between_listing_and_reading(incident):
    # The bus symlink still lists it, its directory is gone (a GPU lost from the bus).
    import shutil

    shutil.rmtree(incident.paths["0000:b0:00.0"])
    rep = report_of(incident)
    assert rep.gpu("0000:b0:00.0") is None
    assert [p for p in rep.pairs if "0000:b0:00.0" in (p.a, p.b)] == []
    assert rep.gpu(XTX[0]).narrowest_link.lower == SLOT[XTX[0]][1]


def test_aer_counters_per_hop(incident):
    rep = report_of(incident)
    rp = rep.gpu(XTX[0]).hops[0]
    assert dict(rp.aer) == {"correctable": 3, "nonfatal": 0, "fatal": 0}
    assert parse_aer("RxErr 1\nBadTLP 2\n") == 3  # no TOTAL line: the sum
    assert parse_aer("garbage") is None


def test_resource_and_dpm_parsers():
    bars = parse_resource(
        "0x0000038000000000 0x000003800fffffff 0x000000000014220c\n"
        "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    )
    assert bars[0].size_bytes == 256 << 20
    with pytest.raises(ValueError, match="resource line 0"):
        parse_resource("0x1 0x2\n")
    assert parse_dpm_pcie("0: 2.5GT/s, x1 78Mhz \n1: 16.0GT/s, x16 623Mhz *\n") == DpmPcieLevel(16.0, 16)
    # RDNA3 stars several levels at once: the fastest counts.
    assert parse_dpm_pcie("0: 16.0GT/s, x16 78Mhz *\n1: 16.0GT/s, x16 156Mhz *\n") == DpmPcieLevel(16.0, 16)
    assert parse_dpm_pcie("") is None


def test_metric_samples(incident):
    rep = report_of(incident)
    ss = list(samples(rep, {XTX[0]: "xtx0"}))
    by = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in ss}
    slot = (("bdf", "0000:a8:00.0"), ("gpu", "xtx0"), ("hop", "5"), ("role", "card_upstream"))
    assert by[("gpuguard_pcie_link_current_transfers_per_second", slot)] == 5.0e9
    assert by[("gpuguard_pcie_link_max_transfers_per_second", slot)] == 16.0e9
    assert by[("gpuguard_pcie_link_downgraded", slot)] == 1.0
    assert by[("gpuguard_gpu_pcie_bottleneck_bytes_per_second", (("gpu", "xtx0"),))] == pytest.approx(8e9)
    assert by[("gpuguard_gpu_bar_bytes", (("bar", "0"), ("gpu", "xtx0")))] == 256 << 20
    # The root port is shared by two GPUs: its AER counter appears once, naming both.
    shared = ",".join(sorted(["xtx0", XTX[1]]))
    assert by[("gpuguard_pcie_aer_errors_total",
               (("bdf", "0000:a0:02.0"), ("gpu", shared), ("severity", "correctable")))] == 3
    aer = [s for s in ss if s.name == "gpuguard_pcie_aer_errors_total" and s.labels["bdf"] == "0000:a0:02.0"]
    assert len(aer) == 3


def test_collector_exposition_parses(incident):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuguard.sinks.pcie_metrics import PcieCollector

    rep = report_of(incident)
    reg = CollectorRegistry()
    reg.register(PcieCollector(lambda: rep))
    text = generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["gpuguard_pcie_aer_errors"].type == "counter"
    assert reg.get_sample_value("gpuguard_gpu_pcie_bottleneck_bytes_per_second", {"gpu": XTX[1]}) == pytest.approx(8e9)
    assert reg.get_sample_value(
        "gpuguard_pcie_link_downgraded", {"gpu": XTX[1], "bdf": "0000:ab:00.0", "hop": "3", "role": "switch_upstream"}
    ) == 0.0


def test_report_is_immutable(incident):
    rep = report_of(incident)
    with pytest.raises(Exception):
        rep.gpus[0].hops[0].bdf = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        rep.host_bridges["pci0000:00"] = "x"  # type: ignore[index]


def test_gpu_on_the_root_bus_without_root_port_uses_its_own_link(pci_tree):
    # A GPU passed through into a VM (QEMU i440fx): no root port above it.
    pci_tree.add("0000:00:00.0", "pci0000:00", "8086:1237", 0x060000, config="none")
    pci_tree.add("0000:00:05.0", "pci0000:00", "10de:2335", 0x030200, port="endpoint", driver="nvidia",
                 cur=(16.0, 8), max=(32.0, 16))
    g = walk(SysfsRoot(str(pci_tree.base)), {"0000:00:05.0": True}).gpu("0000:00:05.0")
    assert g.root_port is None and len(g.hops) == 1
    link = g.narrowest_link
    assert link.upper == "pci0000:00" and link.lower == "0000:00:05.0"
    assert link.downgraded_width and link.downgraded_speed
    assert g.bottleneck_bytes_per_second == pytest.approx(15.754e9, rel=1e-3)
    assert "no root port" in g.root_port_atomics_note


@pytest.mark.parametrize("garbage", [b"", b"\x00\x00\x00", b"\xff\xfe garbage \x80\n", b"0x\n", b"-1\n" * 300])
def test_garbage_in_every_attribute_is_never_a_crash(incident, garbage):
    from gpuguard.policy.doctor import diagnose

    for path in incident.base.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.write_bytes(garbage)
    # A directory where a file should be (EISDIR), and where a directory should be a file.
    os.remove(incident.paths["0000:a0:02.0"] / "config")
    (incident.paths["0000:a0:02.0"] / "config").mkdir()
    hw = incident.paths[XTX[0]] / "hwmon"
    import shutil

    shutil.rmtree(hw)
    hw.write_bytes(b"")
    root = SysfsRoot(str(incident.base))
    rep = walk(root, BUSY)
    assert rep.gpus == ()  # no readable class: nothing is called a GPU
    every = walk(root, BUSY, select=lambda *_: True)
    assert every.gpus
    xtx = every.gpu(XTX[0])
    assert xtx.root_port_atomics is None and "EISDIR" in xtx.root_port_atomics_note
    diagnose(root, every)
    json_ok = document(every)
    assert json_ok["gpus"]


def test_json_schema_keys_are_stable(incident):
    """The published schema (docs/pcie.schema.json): scripts depend on these keys."""
    d = document(report_of(incident))
    assert set(d) == {"schema", "gpus", "pairs", "host_bridges", "nvswitches", "problems"}
    assert set(d["gpus"][0]) == {
        "bdf", "vendor", "device", "class", "driver", "numa_node", "busy", "root_complex", "root_port",
        "slot_link", "narrowest", "hops", "bars", "vram_bytes", "vram_visible_bytes", "large_bar",
        "large_bar_note", "kernel_vram", "root_port_atomics", "root_port_atomics_note", "dpm_pcie_active", "errors",
    }
    assert set(d["gpus"][0]["hops"][1]) == {
        "bdf", "role", "role_inferred", "vendor", "device", "class", "driver", "current_speed_gts",
        "max_speed_gts", "current_width", "max_width", "downgraded", "narrowest", "link", "aer", "errors",
    }
    assert set(d["gpus"][0]["hops"][1]["link"]) == {
        "upper", "lower", "kind", "current_speed_gts", "current_width", "capable_speed_gts", "capable_width",
        "limited_by", "downgraded_speed", "downgraded_width", "bytes_per_second", "capable_bytes_per_second",
    }
    assert set(d["pairs"][0]) == {
        "a", "b", "meet", "at", "at_ids", "host_bridge", "p2p", "directions", "across_root_complexes",
        "across_numa_nodes", "verdict",
    }
    assert set(d["pairs"][0]["directions"][0]) == {"from", "to", "possible", "reason"}


def test_kernel_vram_lines_are_attributed_by_the_one_address_finder():
    """amdgpu's `Detected VRAM` line names its card; on a VMD host the domain has 5 digits."""
    from gpuguard.hw.pcie import kernel_vram

    lines = ["amdgpu 10000:e1:00.0: amdgpu: Detected VRAM RAM=24560M, BAR=256M",
             "amdgpu 0000:05:00.0: amdgpu: Detected VRAM RAM=32624M, BAR=32768M"]
    assert kernel_vram(lines, ["10000:e1:00.0", "0000:aa:00.0"]) == {"10000:e1:00.0": KernelVram(24560, 256)}
    # A line without an address is amdgpu's own only when one AMD GPU exists.
    assert kernel_vram(["[drm] Detected VRAM RAM=24560M, BAR=256M"], ["0000:aa:00.0"]) == {"0000:aa:00.0": KernelVram(24560, 256)}
    assert kernel_vram(["[drm] Detected VRAM RAM=24560M, BAR=256M"], ["0000:aa:00.0", "0000:b0:00.0"]) == {}


def test_narrowest_hop_on_a_tie_is_the_one_nearest_the_root(pci_tree):
    """Two links of equal bandwidth: the documented choice is the one nearest the root
    (the upstream link limits everything below it, so it is the one to fix first)."""
    t = pci_tree
    t.add("0000:00:00.0", "pci0000:00", "8086:6f00", 0x060000)
    gen3 = (8.0, 16)
    t.add("0000:00:02.0", "pci0000:00", "8086:6f04", 0x060400, port="root_port", cur=gen3, max=(16.0, 16),
          driver="pcieport")
    t.add("0000:03:00.0", "0000:00:02.0", "1000:c010", 0x060400, port="switch_upstream", cur=gen3, max=(16.0, 16),
          driver="pcieport")
    t.add("0000:04:00.0", "0000:03:00.0", "1000:c010", 0x060400, port="switch_downstream", cur=gen3,
          max=(16.0, 16), driver="pcieport")
    t.add("0000:05:00.0", "0000:04:00.0", "10de:2335", 0x030200, port="endpoint", cur=gen3, max=(16.0, 16),
          driver="nvidia")
    g = walk(SysfsRoot(str(t.base)), {"0000:05:00.0": True}).gpu("0000:05:00.0")
    links = [(h.link.upper, h.link.lower) for h in g.hops if h.link is not None and h.link.counts]
    assert len(links) == 2  # root port -> switch, switch -> GPU: both 8 GT/s x16
    link = g.narrowest_link
    assert (link.upper, link.lower) == ("0000:00:02.0", "0000:03:00.0")
    assert g.bottleneck_bytes_per_second == pytest.approx(15.754e9, rel=1e-3)
