"""The PCIe model's derived values, exactly: what `gpuguard pcie`, /v1/pcie and the
findings print comes from these properties, so each branch is pinned to hand-derived
figures and words (bench/mutation.sh judges hw/pcie_model.py by tests/pcie)."""

from __future__ import annotations

import pytest

from gpuguard.hw.pcie_model import (
    Bar,
    Bottleneck,
    DpmPcieLevel,
    GpuPair,
    GpuPath,
    KernelVram,
    PcieHop,
    PcieLink,
    PcieReport,
    format_gbps,
    format_speed,
)
from gpuguard.hw.pcie_p2p import PeerDirection

GIB = 1 << 30
MIB = 1 << 20
# 16 GT/s x16 with 128b/130b encoding, per direction: 16e9 * 16 * 128/130 / 8 bytes/s.
GEN4_X16 = 16e9 * 16 * 128 / 130 / 8
GEN5_X16 = 32e9 * 16 * 128 / 130 / 8
GEN3_X8 = 8e9 * 8 * 128 / 130 / 8


def link(upper="0000:00:01.1", lower="0000:01:00.0", kind="external", cur=(16.0, 16), cap=(32.0, 16),
         limited_by=None, down=(False, False)) -> PcieLink:
    return PcieLink(upper, lower, kind, cur[0], cur[1], cap[0], cap[1], limited_by, down[0], down[1])


def hop(bdf, role="bridge", link_=None, narrowest=False, **kw) -> PcieHop:
    return PcieHop(bdf=bdf, role=role, role_inferred=False, vendor=kw.pop("vendor", "1002"),
                   device=kw.pop("device", "1478"), class_code="0x060400", driver="pcieport",
                   current_speed_gts=16.0, max_speed_gts=16.0, current_width=16, max_width=16,
                   link=link_, narrowest=narrowest, **kw)


def gpu(hops, slot_link=None, **kw) -> GpuPath:
    return GpuPath(bdf=hops[-1].bdf if hops else "0000:03:00.0", vendor="1002", device="744c",
                   class_code="0x030000", driver="amdgpu", numa_node=0, busy=kw.pop("busy", False),
                   root_complex="pci0000:00", hops=tuple(hops), slot_link=slot_link, **kw)


def test_speed_and_bandwidth_words():
    assert format_speed(None) == "?"
    assert format_speed(16.0) == "16.0"
    assert format_speed(2.5) == "2.5"
    assert format_speed(8) == "8.0"
    assert format_gbps(None) == "?"
    assert format_gbps(GEN4_X16) == "31.51 GB/s"
    assert format_gbps(1.234e9) == "1.23 GB/s"
    assert format_gbps(0.0) == "0.00 GB/s"
    # Decimal gigabytes, exactly: just past a rounding edge, 1e9 + 1 would round down.
    assert format_gbps(2_125_000_001) == "2.13 GB/s"


def test_link_downgrade_bandwidth_and_whether_it_counts():
    assert link(down=(False, False)).downgraded is False
    assert link(down=(True, False)).downgraded is True
    assert link(down=(False, True)).downgraded is True
    assert link(down=(True, True)).downgraded is True
    l = link(cur=(16.0, 16), cap=(32.0, 16))
    assert l.bytes_per_second == pytest.approx(GEN4_X16, rel=1e-12)
    assert l.capable_bytes_per_second == pytest.approx(GEN5_X16, rel=1e-12)
    assert link(cur=(8.0, 8), cap=(8.0, 8)).bytes_per_second == pytest.approx(GEN3_X8, rel=1e-12)
    assert link(cur=(None, 16)).bytes_per_second is None
    assert link(cap=(32.0, None)).capable_bytes_per_second is None
    assert link(kind="external").counts is True
    assert link(kind="card_internal").counts is True
    assert link(kind="switch_internal").counts is False


def test_hop_ids_and_frozen_maps():
    h = hop("0000:01:00.0", aer={"fatal": 1, "nonfatal": 0}, errors={"max_link_speed": "EIO"})
    assert h.ids == "1002:1478"
    assert hop("0000:01:00.0", vendor=None, device=None).ids == "????:????"
    assert hop("0000:01:00.0", vendor="10de", device=None).ids == "10de:????"
    assert dict(h.aer) == {"fatal": 1, "nonfatal": 0}
    assert dict(h.errors) == {"max_link_speed": "EIO"}
    with pytest.raises(TypeError):
        h.aer["fatal"] = 2  # type: ignore[index]
    g = gpu([h], errors={"bars": "resource unreadable"})
    assert dict(g.errors) == {"bars": "resource unreadable"}
    with pytest.raises(TypeError):
        g.errors["bars"] = "x"  # type: ignore[index]


def test_root_port_only_when_the_path_starts_at_one():
    assert gpu([]).root_port is None
    assert gpu([]).root_port_bdf is None
    rp = hop("0000:00:01.1", role="root_port")
    g = gpu([rp, hop("0000:01:00.0", role="switch_upstream"), hop("0000:03:00.0", role="gpu")])
    assert g.root_port is rp
    assert g.root_port_bdf == "0000:00:01.1"
    # A GPU on the root bus: its path starts at the GPU, no root port above it.
    on_bus = gpu([hop("0000:00:02.0", role="gpu")])
    assert on_bus.root_port is None
    assert on_bus.root_port_bdf is None
    # A root port that is not first (never built that way) is not taken for the GPU's.
    assert gpu([hop("0000:01:00.0", role="switch_upstream"), hop("0000:00:01.1", role="root_port")]).root_port is None


def test_narrowest_and_bottleneck_name_the_flagged_hop_and_its_link():
    up = link("0000:00:01.1", "0000:01:00.0", cur=(16.0, 16), limited_by=None)
    mid = link("0000:02:00.0", "0000:03:00.0", kind="card_internal", cur=(8.0, 8), cap=(16.0, 16),
               limited_by="0000:03:00.0", down=(True, True))
    hops = [hop("0000:00:01.1", role="root_port"), hop("0000:01:00.0", link_=up),
            hop("0000:02:00.0"), hop("0000:03:00.0", role="gpu", link_=mid, narrowest=True)]
    g = gpu(hops, slot_link=1)
    assert g.narrowest == 3
    assert g.narrowest_hop is hops[3]
    assert g.narrowest_link is mid
    assert g.bottleneck == Bottleneck(3, "0000:02:00.0", "0000:03:00.0", pytest.approx(GEN3_X8, rel=1e-12),
                                      "0000:03:00.0")
    assert g.bottleneck_bytes_per_second == pytest.approx(GEN3_X8, rel=1e-12)
    assert g.slot is up
    # The first flagged hop counts (the walk flags one; ties go to the root side).
    hops2 = [hops[0], hop("0000:01:00.0", link_=up, narrowest=True), hops[2], hops[3]]
    assert gpu(hops2).narrowest == 1
    assert gpu(hops2).bottleneck == Bottleneck(1, "0000:00:01.1", "0000:01:00.0",
                                               pytest.approx(GEN4_X16, rel=1e-12), None)
    # Index 0 is a real answer, not "none".
    first = gpu([hop("0000:00:02.0", role="gpu", link_=up, narrowest=True)], slot_link=0)
    assert first.narrowest == 0
    assert first.bottleneck.hop == 0
    assert first.slot is up


def test_no_bottleneck_without_a_flagged_hop_or_its_link():
    g = gpu([hop("0000:00:01.1", role="root_port"), hop("0000:03:00.0", role="gpu", link_=link())])
    assert (g.narrowest, g.narrowest_hop, g.narrowest_link, g.bottleneck, g.bottleneck_bytes_per_second) == (
        None, None, None, None, None)
    assert g.slot is None
    flagged_without_link = gpu([hop("0000:00:01.1", role="root_port", narrowest=True)])
    assert flagged_without_link.narrowest == 0
    assert flagged_without_link.narrowest_link is None
    assert flagged_without_link.bottleneck is None
    assert flagged_without_link.bottleneck_bytes_per_second is None


@pytest.mark.parametrize("busy, dpm, current, real", [
    (True, None, 2.5, True),            # working: any drop is real
    (False, None, 2.5, False),          # idle and no dpm level: ASPM/dynamic PCIe
    (False, 16.0, 8.0, True),           # idle but amdgpu's active level asks for more
    (False, 8.0, 8.0, False),
    (False, 8.0, 16.0, False),
    (False, 16.0, None, False),
])
def test_speed_drop_is_real_only_while_busy_or_below_the_active_dpm_level(busy, dpm, current, real):
    level = DpmPcieLevel(dpm, 16) if dpm is not None else None
    assert gpu([hop("0000:03:00.0", role="gpu")], busy=busy, dpm_pcie_active=level).speed_drop_is_real(current) is real


def test_large_bar_rests_on_the_best_figure_and_names_it():
    bars = (Bar(0, 256 * MIB, True, True), Bar(2, 32 * GIB, True, True), Bar(4, 2 * MIB, False, False))
    g = gpu([hop("0000:03:00.0", role="gpu")], bars=bars, vram_bytes=32 * GIB)
    assert g.large_bar is True
    assert g.large_bar_note == "large BAR active: BAR2 32 GiB for 32 GiB VRAM"
    small = gpu([hop("0000:03:00.0", role="gpu")], bars=bars[:1] + bars[2:], vram_bytes=24 * GIB)
    assert small.large_bar is False
    assert small.large_bar_note == "large BAR not active: BAR0 256 MiB for 24 GiB VRAM"
    visible = gpu([hop("0000:03:00.0", role="gpu")], bars=bars, vram_bytes=24 * GIB, vram_visible_bytes=256 * MIB)
    assert visible.large_bar is False
    assert visible.large_bar_note == "large BAR not active: CPU sees 256 MiB of 24 GiB VRAM"
    kernel = gpu([hop("0000:03:00.0", role="gpu")], kernel_vram=KernelVram(24560, 256))
    assert kernel.large_bar is False
    assert kernel.large_bar_note == "large BAR not active: kernel log Detected VRAM RAM=24560M, BAR=256M"
    unknown = gpu([hop("0000:03:00.0", role="gpu")])
    assert unknown.large_bar is None
    assert unknown.large_bar_note == "large BAR unknown: the driver exports no VRAM size (mem_info_vram_total)"


A, B = "0000:03:00.0", "0000:83:00.0"


def pair(meet="host_bridge", p2p="maybe", directions=(), **kw) -> GpuPair:
    return GpuPair(a=A, b=B, meet=meet, at=kw.pop("at", "pci0000:00"), at_ids=kw.pop("at_ids", "1022:1483"),
                   host_bridge=kw.pop("host_bridge", "1022:14a4"), p2p=p2p, directions=tuple(directions), **kw)


def test_where_a_pair_meets_in_words():
    assert pair("switch", at="0000:02:00.0", at_ids="1002:1479").meeting == (
        "meet under switch 0000:02:00.0 (1002:1479)")
    assert pair("root_port", at="0000:00:01.1", at_ids="1022:1483").meeting == (
        "meet at root port 0000:00:01.1 (1022:1483)")
    assert pair().meeting == "meet at host bridge 1022:14a4 (pci0000:00)"
    assert pair(host_bridge=None).meeting == "meet at host bridge unknown host bridge (pci0000:00)"
    assert pair(at="pci0000:00+pci0000:80", across_root_complexes=True).meeting == (
        "meet at host bridge 1022:14a4 across root complexes (pci0000:00+pci0000:80)")
    # Different sockets say so, whether or not the root complexes differ too.
    assert pair(at="pci0000:00+pci0000:80", across_root_complexes=True, across_numa_nodes=True).meeting == (
        "meet at host bridges 1022:14a4 on different CPU sockets (pci0000:00+pci0000:80)")
    assert pair(across_numa_nodes=True, host_bridge=None).meeting == (
        "meet at host bridges unknown host bridge on different CPU sockets (pci0000:00)")


def test_p2p_text_names_the_direction_that_works():
    ways = (PeerDirection(A, B, False, "the IOMMU blocks it"), PeerDirection(B, A, True, "same root port"))
    assert pair(p2p="one-way", directions=ways).p2p_text == "one-way (83:00.0→03:00.0)"
    ways2 = (PeerDirection(A, B, True, "same root port"), PeerDirection(B, A, False, "the IOMMU blocks it"))
    assert pair(p2p="one-way", directions=ways2).p2p_text == "one-way (03:00.0→83:00.0)"
    for word in ("yes", "no", "maybe"):
        assert pair(p2p=word).p2p_text == word


def test_pair_verdict_per_direction_when_they_differ():
    assert pair(p2p="yes").verdict == "meet at host bridge 1022:14a4 (pci0000:00)"
    both = (PeerDirection(A, B, True, "under one switch"), PeerDirection(B, A, True, "under one switch"))
    assert pair("switch", "yes", both, at="0000:02:00.0", at_ids="1002:1479").verdict == (
        "meet under switch 0000:02:00.0 (1002:1479): P2P both ways (under one switch)")
    same_no = (PeerDirection(A, B, False, "AMD host bridge before Zen"),
               PeerDirection(B, A, False, "AMD host bridge before Zen"))
    assert pair(p2p="no", directions=same_no).verdict == (
        "meet at host bridge 1022:14a4 (pci0000:00): no P2P: AMD host bridge before Zen")
    differ_no = (PeerDirection(A, B, False, "ACS redirects it"), PeerDirection(B, A, False, "the IOMMU blocks it"))
    assert pair(p2p="no", directions=differ_no).verdict == (
        "meet at host bridge 1022:14a4 (pci0000:00): no P2P; "
        "03:00.0→83:00.0 no: ACS redirects it; 83:00.0→03:00.0 no: the IOMMU blocks it")
    one_way = (PeerDirection(A, B, True, "same root port"), PeerDirection(B, A, False, "ACS redirects it"))
    assert pair(p2p="one-way", directions=one_way).verdict == (
        "meet at host bridge 1022:14a4 (pci0000:00): P2P one way only; "
        "03:00.0→83:00.0 yes: same root port; 83:00.0→03:00.0 no: ACS redirects it")
    unknown = (PeerDirection(A, B, None, "host bridge not on the kernel's list"),
               PeerDirection(B, A, None, "host bridge not on the kernel's list"))
    assert pair(p2p="maybe", directions=unknown).verdict == (
        "meet at host bridge 1022:14a4 (pci0000:00): P2P unknown; "
        "03:00.0→83:00.0 unknown: host bridge not on the kernel's list; "
        "83:00.0→03:00.0 unknown: host bridge not on the kernel's list")


def test_report_finds_a_gpu_and_a_pair_in_either_order():
    g1, g2 = gpu([hop(A, role="gpu")]), gpu([hop(B, role="gpu")])
    p = pair()
    r = PcieReport(gpus=(g1, g2), pairs=(p,), host_bridges={"pci0000:00": "1022:14a4"})
    assert r.schema == 1
    assert r.gpu(B) is g2
    assert r.gpu("0000:04:00.0") is None
    assert r.pair(A, B) is p and r.pair(B, A) is p
    assert r.pair(A, "0000:04:00.0") is None
    assert dict(r.host_bridges) == {"pci0000:00": "1022:14a4"}
    with pytest.raises(TypeError):
        r.host_bridges["pci0000:80"] = None  # type: ignore[index]
