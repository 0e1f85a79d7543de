"""Pair verdicts by the kernel's rules (issue 14, INCIDENTS §5), per direction: amdgpu lets a
peer into a card's VRAM only when that card's BAR covers all of it, and p2pdma allows the
path (common upstream bridge, or a host bridge on its list / an AMD Zen CPU)."""
from __future__ import annotations

from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_p2p import parse_cpuinfo, refusals
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.doctor import diagnose
from gpuguard.sinks.pcie_metrics import samples

from pcie.conftest import GIB, MIB, PciTree, amd_gpu_files

GEN4 = (16.0, 16)
A, B = "0000:03:00.0", "0000:04:00.0"
VRAM = 24 * GIB


def gpu_files(large: bool) -> dict[str, str]:
    return amd_gpu_files(VRAM, VRAM if large else 256 * MIB, 32 * GIB if large else 256 * MIB, busy=100)


def switch_host(tree: PciTree, large_a: bool, large_b: bool, hb: str = "8086:6f00") -> PciTree:
    """Two cards under one PCIe switch on one root port."""
    tree.add("0000:00:00.0", "pci0000:00", hb, 0x060000)
    tree.add("0000:00:01.0", "pci0000:00", "8086:6f02", 0x060400, port="root_port", cur=GEN4, max=GEN4)
    tree.add("0000:01:00.0", "0000:00:01.0", "1000:c010", 0x060400, port="switch_upstream", cur=GEN4, max=GEN4)
    for port, gpu, large in (("0000:02:00.0", A, large_a), ("0000:02:01.0", B, large_b)):
        tree.add(port, "0000:01:00.0", "1000:c010", 0x060400, port="switch_downstream", cur=GEN4, max=GEN4)
        tree.add(gpu, port, "1002:7551", 0x030000, port="endpoint", cur=GEN4, max=GEN4, driver="amdgpu",
                 files=gpu_files(large))
    return tree


def root_port_host(tree: PciTree, hb: str, *, two_complexes: bool = False, cpuinfo: str | None = None,
                   nvidia: bool = False) -> PciTree:
    """Two large-BAR cards on separate CPU root ports: traffic goes through the host bridge."""
    rc_b = "pci0000:80" if two_complexes else "pci0000:00"
    tree.add("0000:00:00.0", "pci0000:00", hb, 0x060000)
    if two_complexes:
        tree.add("0000:80:00.0", "pci0000:80", hb, 0x060000)
    for rc, rp, gpu in (("pci0000:00", "0000:00:02.0", "0000:01:00.0"),
                        (rc_b, f"0000:{rc_b[-2:]}:03.0", f"0000:{'81' if two_complexes else '02'}:00.0")):
        tree.add(rp, rc, "8086:6f04", 0x060400, port="root_port", cur=GEN4, max=GEN4)
        if nvidia:
            tree.add(gpu, rp, "10de:2335", 0x030200, port="endpoint", cur=GEN4, max=GEN4, driver="nvidia")
        else:
            tree.add(gpu, rp, "1002:7551", 0x030000, port="endpoint", cur=GEN4, max=GEN4, driver="amdgpu",
                     files=gpu_files(True))
    if cpuinfo is not None:
        (tree.base / "proc").mkdir(exist_ok=True)
        (tree.base / "proc/cpuinfo").write_text(cpuinfo)
    return tree


def only_pair(tree: PciTree, lines=()):
    rep = walk(SysfsRoot(str(tree.base)), kernel_lines=lines)
    assert len(rep.pairs) == 1
    return rep, rep.pairs[0]


def test_two_small_bar_cards_under_a_switch_no_p2p(make_tree):
    _, p = only_pair(switch_host(make_tree(), False, False))
    assert p.meet == "switch" and p.p2p == "no"
    assert [d.possible for d in p.directions] == [False, False]
    assert all(d.reason.startswith(f"small BAR on {d.owner}") and "256 MiB of 24 GiB" in d.reason for d in p.directions)


def test_two_large_bar_cards_under_a_switch_p2p_yes(make_tree):
    rep, p = only_pair(switch_host(make_tree(), True, True))
    assert p.p2p == "yes" and p.p2p_text == "yes"
    assert all(d.possible and "common upstream bridge: switch 0000:01:00.0" in d.reason for d in p.directions)
    fs = [f for f in diagnose(SysfsRoot("/nonexistent"), rep) if f.check == "pair"]
    assert [f.level for f in fs] == ["OK"] and "both ways" in fs[0].what


def test_one_large_one_small_bar_is_one_way(make_tree):
    # A has the small BAR: B cannot get into A's VRAM; A can get into B's.
    rep, p = only_pair(switch_host(make_tree(), False, True))
    ab, ba = p.directions
    assert (ab.reader, ab.owner, ab.possible) == (A, B, True)
    assert (ba.reader, ba.owner, ba.possible) == (B, A, False) and f"small BAR on {A}" in ba.reason
    assert p.p2p == "one-way" and p.p2p_text == "one-way (03:00.0→04:00.0)"
    fs = [f for f in diagnose(SysfsRoot("/nonexistent"), rep) if f.check == "pair"]
    assert fs[0].level == "WARN" and "one way" in fs[0].what and A in fs[0].todo
    got = {(s.labels["direction"]): s.value for s in samples(rep) if s.name == "gpuguard_gpu_pair_p2p"}
    assert got == {"a_to_b": 1.0, "b_to_a": 0.0}


def test_large_bar_cards_across_a_refused_host_bridge(make_tree):
    # INCIDENTS §5: X99 (8086:6f00) is not on p2pdma's list; the CPU is Intel.
    _, p = only_pair(root_port_host(make_tree(), "8086:6f00", cpuinfo="vendor_id\t: GenuineIntel\ncpu family\t: 6\n"))
    assert p.meet == "host_bridge" and p.p2p == "no"
    assert all("not on the kernel's p2pdma host-bridge list" in d.reason for d in p.directions)


def test_large_bar_cards_across_an_allowed_host_bridge(make_tree):
    # Skylake-E 8086:2030 is on the list without REQ_SAME_HOST_BRIDGE: even across two.
    _, p = only_pair(root_port_host(make_tree(), "8086:2030", two_complexes=True))
    assert p.p2p == "yes" and all("p2pdma host-bridge list" in d.reason for d in p.directions)
    # Haswell-E 8086:2f00 is listed only within one host bridge.
    _, p = only_pair(root_port_host(make_tree(), "8086:2f00"))
    assert p.p2p == "yes"
    _, p = only_pair(root_port_host(make_tree(), "8086:2f00", two_complexes=True))
    assert p.p2p == "no" and "only for peers under one host bridge" in p.directions[0].reason


def test_nvidia_pair_across_a_refused_host_bridge_is_unknown_not_no(make_tree):
    # The kernel's p2pdma list binds amdgpu; NVIDIA's driver judges host-bridge P2P itself.
    _, p = only_pair(root_port_host(make_tree(), "8086:6f00", nvidia=True))
    assert p.p2p == "maybe" and "nvidia-smi topo -p2p r" in p.directions[0].reason


def test_amd_zen_cpu_allows_the_host_bridge_path(make_tree):
    zen = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\n"
    _, p = only_pair(root_port_host(make_tree(), "1022:14d8", cpuinfo=zen))
    assert p.p2p == "yes" and "AMD Zen or newer CPU (family 0x19)" in p.directions[0].reason
    # Without /proc/cpuinfo an AMD host bridge says nothing certain: unknown, not yes.
    _, p = only_pair(root_port_host(make_tree(), "1022:14d8"))
    assert p.p2p == "maybe" and "/proc/cpuinfo" in p.directions[0].reason


def test_a_kernel_refusal_line_decides_its_direction(make_tree):
    line = f"amdgpu {B}: amdgpu: PCIe P2P access from peer device {A} is not supported by the chipset"
    assert refusals([line]) == {(A, B): line}
    _, p = only_pair(switch_host(make_tree(), True, True), [line])
    ab, ba = p.directions
    assert ab.possible is False and "kernel refused it" in ab.reason and ba.possible is True
    assert p.p2p == "one-way"


def test_parse_cpuinfo_reads_cpu_0():
    cpu = parse_cpuinfo("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\n\nvendor_id\t: x\n")
    assert (cpu.vendor, cpu.family, cpu.supports_p2pdma) == ("AuthenticAMD", 23, True)
    assert not parse_cpuinfo("vendor_id : GenuineIntel\ncpu family : 6\n").supports_p2pdma
    assert parse_cpuinfo("").vendor is None


def test_demo_xtx_pair_says_no_citing_the_256_mib_bar(tmp_path):
    from gpuguard.sim.host import SimHost
    from gpuguard.sim.topology import incident_spec
    from gpuguard.sim.tree import write_tree

    write_tree(SimHost(incident_spec()), str(tmp_path / "sim"))
    rep = walk(SysfsRoot(str(tmp_path / "sim")))
    p = rep.pair("0000:aa:00.0", "0000:b0:00.0")
    assert p.meet == "switch" and p.p2p == "no"
    assert "256 MiB" in p.verdict and "small BAR" in p.verdict


def test_the_daemon_feeds_kernel_refusals_seen_by_the_kmsg_reader_into_the_verdict(make_tree):
    import asyncio

    from gpuguard.pcie_walker import PcieWalker
    from gpuguard.state.events import Event
    from gpuguard.state.hub import Hub

    tree = switch_host(make_tree(), True, True)
    hub = Hub()
    watch = PcieWalker(hub, SysfsRoot(str(tree.base)))
    assert asyncio.run(watch.check_once()).pairs[0].p2p == "yes"
    line = f"amdgpu {A}: amdgpu: PCIe P2P access from peer device {B} is not supported by the chipset"
    hub.publish(Event("p2p_unsupported", "warning", "kernel", line, bdf=A))
    p = asyncio.run(watch.check_once()).pairs[0]
    assert p.p2p == "one-way" and p.directions[1].possible is False and "kernel refused" in p.directions[1].reason


def test_a_capture_keeps_cpu_0_so_a_replay_judges_pairs_like_the_host(make_tree, tmp_path):
    from gpuguard.hw.pcie_capture import capture, replay

    zen = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n"
    tree = root_port_host(make_tree(), "1022:14d8", cpuinfo=zen)
    capture(SysfsRoot(str(tree.base)), str(tmp_path / "cap.txt"))
    replay(str(tmp_path / "cap.txt"), str(tmp_path / "replayed"))
    assert (tmp_path / "replayed/proc/cpuinfo").read_text() == zen.split("\n\n")[0] + "\n"
    _, live = only_pair(tree)
    rep = walk(SysfsRoot(str(tmp_path / "replayed")))
    assert live.p2p == rep.pairs[0].p2p == "yes"


def test_doctor_kernel_log_refusal_is_no_longer_an_ok_pair(make_tree, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tree = switch_host(make_tree(), True, True)
    log = tmp_path / "dmesg.txt"
    log.write_text(f"[    5.1] amdgpu {B}: amdgpu: PCIe P2P access from peer device {A} is not supported by the chipset\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "daemon"), NO_COLOR="1")
    p = subprocess.run([sys.executable, "-m", "gpuguard", "doctor", "--sysfs-root", str(tree.base), "--kernel-log", str(log)],
                       env=env, capture_output=True, text=True, timeout=120)
    pair = next(ln for ln in p.stdout.splitlines() if " pair " in ln and "↔" in ln)
    assert pair.startswith("WARN") and "one way" in pair and "kernel refused it" in pair, pair
