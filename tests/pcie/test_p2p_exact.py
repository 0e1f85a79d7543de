"""The P2P rules' exact words and edges, on paths built by hand (the walk is tested apart):
CPU 0 from /proc/cpuinfo, the kernel's refusal lines (both forms, reader and owner the
right way round), the common upstream bridge, the host-bridge rule across sockets and
unknown ids, which GPUs count as amdgpu, the BAR rule of a non-AMD owner, what NVIDIA
decides itself, and the pair's summary. bench/mutation.sh found these unobserved."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuguard.hw.pcie_p2p import Cpu, PathRule, PeerDirection, _bar_rule, _is_amd, direction, parse_cpuinfo, \
    path_rule, refusals, summary

INTEL = Cpu("GenuineIntel", 6)


def test_cpu_0_from_cpuinfo():
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n\n"
            "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    assert parse_cpuinfo(text) == Cpu("AuthenticAMD", 25)
    assert parse_cpuinfo("processor\t: 0\ncpu family\t: 25\n") == Cpu(None, 25)        # no vendor line
    assert parse_cpuinfo("processor\t: 0\nvendor_id\t: GenuineIntel\n") == Cpu("GenuineIntel", None)


AMDGPU_LINE = "amdgpu 0000:0a:00.0: amdgpu: PCIe P2P access from peer device 0000:0b:00.0 is not supported by the chipset"
P2PDMA_LINE = ("pci 0000:0c:00.0: cannot be used for peer-to-peer DMA as the client and provider (0000:0d:00.0) "
               "do not share an upstream bridge or whitelisted host bridge")


def test_refusal_lines_name_reader_and_owner_the_right_way_round():
    # amdgpu logs on the accessed device (the owner), naming the peer (the reader);
    # p2pdma logs on the client (the reader), naming the provider (the owner)
    assert refusals([f"  {AMDGPU_LINE}  ", "unrelated", P2PDMA_LINE]) == {
        ("0000:0b:00.0", "0000:0a:00.0"): AMDGPU_LINE,
        ("0000:0c:00.0", "0000:0d:00.0"): P2PDMA_LINE,
    }
    assert refusals([AMDGPU_LINE.upper()]) == {("0000:0b:00.0", "0000:0a:00.0"): AMDGPU_LINE.upper()}


def hop(bdf: str, role: str, ids: str = "8086:6f04") -> SimpleNamespace:
    return SimpleNamespace(bdf=bdf, role=role, ids=ids)


def gpu(bdf: str, hops: list, complex_: str = "pci0000:00", numa: int | None = 0, driver: str | None = "amdgpu",
        vendor: str = "1002", large_bar: bool | None = True, vram: int | None = 32 << 30,
        visible: int | None = 32 << 30, note: str = "BAR covers VRAM") -> SimpleNamespace:
    return SimpleNamespace(bdf=bdf, hops=hops, root_complex=complex_, numa_node=numa, driver=driver, vendor=vendor,
                           large_bar=large_bar, vram_bytes=vram, vram_visible_bytes=visible, large_bar_note=note)


@pytest.mark.parametrize("role,word", [("root_port", "root port"), ("switch_upstream", "switch")])
def test_a_common_upstream_bridge(role, word):
    common = hop("0000:00:02.0", role)
    a = gpu("0000:03:00.0", [common, hop("0000:01:00.0", "switch_downstream")])
    b = gpu("0000:04:00.0", [common, hop("0000:02:00.0", "switch_downstream")])
    assert path_rule(a, b, {}, INTEL) == PathRule(True, f"common upstream bridge: {word} 0000:00:02.0 (8086:6f04)",
                                                  False)


def _apart(numa_a=0, numa_b=1):
    a = gpu("0000:05:00.0", [hop("0000:00:02.0", "root_port")], "pci0000:00", numa_a)
    b = gpu("0000:aa:00.0", [hop("0000:a0:02.0", "root_port")], "pci0000:a0", numa_b)
    return a, b


def test_two_host_bridges_on_two_sockets_not_on_the_list():
    a, b = _apart()
    bridges = {"pci0000:00": "8086:6f00", "pci0000:a0": "8086:6f00"}
    assert path_rule(a, b, bridges, INTEL) == PathRule(False, (
        "through host bridges 8086:6f00 / 8086:6f00 (pci0000:00 / pci0000:a0) on different CPU sockets: "
        "not on the kernel's p2pdma host-bridge list: chipset refuses P2P"))


@pytest.mark.parametrize("numa_a,numa_b", [(None, 1), (0, None), (0, 0)])
def test_no_socket_words_unless_both_nodes_are_known_and_differ(numa_a, numa_b):
    a, b = _apart(numa_a, numa_b)
    bridges = {"pci0000:00": "8086:6f00", "pci0000:a0": "8086:6f00"}
    assert path_rule(a, b, bridges, INTEL).reason == (
        "through host bridges 8086:6f00 / 8086:6f00 (pci0000:00 / pci0000:a0): "
        "not on the kernel's p2pdma host-bridge list: chipset refuses P2P")


def test_a_listed_host_bridge_that_needs_one_bridge_for_both():
    a, b = _apart()
    bridges = {"pci0000:00": "8086:2f00", "pci0000:a0": "8086:2f00"}
    assert path_rule(a, b, bridges, INTEL).reason == (
        "through host bridges 8086:2f00 / 8086:2f00 (pci0000:00 / pci0000:a0) on different CPU sockets: "
        "listed only for peers under one host bridge: chipset refuses P2P")
    same_a = gpu("0000:05:00.0", [hop("0000:00:02.0", "root_port")])
    same_b = gpu("0000:08:00.0", [hop("0000:00:03.0", "root_port")])
    assert path_rule(same_a, same_b, {"pci0000:00": "8086:2f00"}, INTEL) == PathRule(
        True, "through host bridge 8086:2f00: on the kernel's p2pdma host-bridge list")


def test_unknown_host_bridge_ids_are_said():
    a, b = _apart()
    assert path_rule(a, b, {"pci0000:00": "8086:6f00"}, INTEL) == PathRule(None, (
        "through host bridges 8086:6f00 / ? (pci0000:00 / pci0000:a0): host bridge id unknown, "
        "the kernel's p2pdma list cannot be checked"))
    assert path_rule(a, b, {"pci0000:a0": "8086:6f00"}, INTEL).reason.startswith(
        "through host bridges ? / 8086:6f00 (pci0000:00 / pci0000:a0): ")
    same_a = gpu("0000:05:00.0", [hop("0000:00:02.0", "root_port")])
    same_b = gpu("0000:08:00.0", [hop("0000:00:03.0", "root_port")])
    assert path_rule(same_a, same_b, {}, INTEL).reason == (
        "through host bridge ?: host bridge id unknown, the kernel's p2pdma list cannot be checked")


@pytest.mark.parametrize("driver,vendor,amd", [
    ("amdgpu", "1002", True), (None, "1002", True), ("vfio-pci", "1002", False), (None, "10de", False),
    ("nvidia", "10de", False)])
def test_which_gpus_amdgpus_rules_apply_to(driver, vendor, amd):
    assert _is_amd(gpu("0000:01:00.0", [], driver=driver, vendor=vendor)) is amd


def test_a_non_amd_owner_has_no_bar_rule_and_a_small_bar_without_sizes_uses_the_note():
    assert _bar_rule(gpu("0000:01:00.0", [], driver="nvidia", vendor="10de")) == (True, "")
    small = gpu("0000:01:00.0", [], large_bar=False, vram=None, visible=None, note="256 MiB BAR")
    assert _bar_rule(small) == (False, "small BAR on 0000:01:00.0: the CPU sees 256 MiB BAR VRAM, amdgpu needs "
                                       "all of it for P2P")


def test_directions_in_words():
    a = gpu("0000:05:00.0", [])
    nv = gpu("0000:aa:00.0", [], driver="nvidia", vendor="10de")
    refused = PathRule(False, "through host bridges x / y: not on the kernel's p2pdma host-bridge list: chipset "
                              "refuses P2P")
    # the kernel's line, cut at 200 characters
    long_line = "x" * 300
    assert direction(a, a, refused, {(a.bdf, a.bdf): long_line}) == PeerDirection(
        a.bdf, a.bdf, False, "kernel refused it: " + "x" * 200)
    # a host-bridge path the kernel list refuses: NVIDIA on either end decides itself
    for reader, owner in ((nv, a), (a, nv)):
        assert direction(reader, owner, refused, {}) == PeerDirection(
            reader.bdf, owner.bdf, None, refused.reason + " for amdgpu; the NVIDIA driver decides host-bridge P2P "
                                                          "itself (nvidia-smi topo -p2p r)")
    assert direction(a, a, refused, {}) == PeerDirection(a.bdf, a.bdf, False, refused.reason)
    unknown_bar = gpu("0000:08:00.0", [], large_bar=None, note="BAR size unreadable")
    unknown_path = PathRule(None, "through host bridge ?: host bridge id unknown")
    assert direction(a, unknown_bar, unknown_path, {}).reason == (
        "0000:08:00.0: BAR size unreadable; through host bridge ?: host bridge id unknown")
    ok = PathRule(True, "common upstream bridge: switch 0000:a2:00.0 (1000:c010)", False)
    assert direction(a, a, ok, {}) == PeerDirection(
        a.bdf, a.bdf, True, "common upstream bridge: switch 0000:a2:00.0 (1000:c010); 0000:05:00.0 BAR covers all "
                            "its VRAM")


@pytest.mark.parametrize("ab,ba,word", [
    (True, True, "yes"), (False, False, "no"), (True, False, "one-way"), (False, True, "one-way"),
    (None, False, "maybe"), (False, None, "maybe"), (None, True, "maybe"), (True, None, "maybe"), (None, None, "maybe")])
def test_the_pairs_summary(ab, ba, word):
    assert summary(PeerDirection("a", "b", ab, ""), PeerDirection("b", "a", ba, "")) == word
