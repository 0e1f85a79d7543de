"""The capture format: round trips of built trees, bad captures named by line, and every
real capture under tests/fixtures/pcie/ replayed and walked (the integrator adds real
GPU hosts there; each needs only its `*.pcie.txt`, an optional golden `*.pcie.json` is
compared when present and rewritten with GPUGUARD_REGEN=1)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuguard.document import document
from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_capture import MAGIC, CaptureError, capture, capture_lines, parse_capture, replay
from gpuguard.hw.pcie_config import parse_config
from gpuguard.hw.sysfs import SysfsRoot

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "pcie"
CAPTURES = sorted(FIXTURES.glob("*.pcie.txt"))
XTX = ("0000:aa:00.0", "0000:b0:00.0")


def _body(lines: list[str]) -> list[str]:
    return [ln for ln in lines if not ln.startswith("#")]


def test_round_trip_of_the_incident_host_walks_identically(incident, tmp_path):
    src = SysfsRoot(str(incident.base))
    out = tmp_path / "host.pcie.txt"
    summary = capture(src, str(out))
    assert summary.errors == 0 and summary.devices >= 20
    dest = tmp_path / "replayed"
    assert replay(str(out), str(dest)) == []
    busy = {b: True for b in XTX}
    assert document(walk(SysfsRoot(str(dest)), busy)) == document(walk(src, busy))
    # Capturing the replayed tree gives the same archive (the format is stable to diff).
    again, _ = capture_lines(SysfsRoot(str(dest)))
    first = out.read_text().splitlines()
    assert _body(again) == _body(first)


def test_default_scope_keeps_gpu_paths_and_host_bridges_only(incident):
    lines, _ = capture_lines(SysfsRoot(str(incident.base)))
    links = {ln.split()[1].rsplit("/", 1)[-1] for ln in lines if ln.startswith("link sys/bus/pci/devices/")}
    assert "0000:a1:00.0" in links and "0000:00:00.0" in links and "0000:aa:00.1" in links
    assert "0000:00:1c.0" not in links  # the BMC's bridge is on no GPU path
    all_lines, _ = capture_lines(SysfsRoot(str(incident.base)), all_devices=True)
    assert any(ln.endswith("/0000:00:1c.0") for ln in all_lines if ln.startswith("link "))


def test_exact_bytes_survive(pci_tree, tmp_path):
    pci_tree.add("0000:00:00.0", "pci0000:00", "8086:6f00", 0x060000)
    p = pci_tree.add("0000:00:02.0", "pci0000:00", "1002:744c", 0x030000, driver="amdgpu", port="endpoint",
                     cur=(16.0, 16), max=(16.0, 16))
    (p / "pp_od_clk_voltage").write_bytes(b"OD_SCLK:\n0: 500Mhz\n\x00\x00\x00")  # NUL runs (SOURCES.md)
    (p / "gpu_busy_percent").write_bytes(b"7")  # no trailing newline
    (p / "mem_info_vram_total").write_bytes(b"")  # empty
    (p / "boot_vga").write_bytes(b"  1  \n\n")  # blanks and an empty last line
    out = tmp_path / "c.pcie.txt"
    capture(SysfsRoot(str(pci_tree.base)), str(out))
    dest = tmp_path / "r"
    replay(str(out), str(dest))
    rp = dest / "sys/devices/pci0000:00/0000:00:02.0"
    for name in ("pp_od_clk_voltage", "gpu_busy_percent", "mem_info_vram_total", "boot_vga", "config"):
        assert (rp / name).read_bytes() == ((p / name).read_bytes()[:256] if name == "config" else (p / name).read_bytes()), name
    assert os.readlink(rp / "driver") == os.readlink(p / "driver")
    assert os.path.realpath(dest / "sys/bus/pci/devices/0000:00:02.0") == str(rp)


def test_unreadable_file_is_recorded_as_error(pci_tree, tmp_path, monkeypatch):
    pci_tree.add("0000:00:02.0", "pci0000:00", "10de:2335", 0x030200, driver="nvidia")
    # A FIFO reads as EINVAL-free but blocks; a directory where a file should be gives EISDIR.
    # Use a file the kernel would refuse: make `resource` a dangling symlink loop (ELOOP).
    res = pci_tree.paths["0000:00:02.0"] / "resource"
    os.symlink("resource", res)
    lines, summary = capture_lines(SysfsRoot(str(pci_tree.base)))
    assert summary.errors == 1
    assert "error sys/devices/pci0000:00/0000:00:02.0/resource ELOOP" in lines
    dest = tmp_path / "r"
    entries = parse_capture("\n".join(lines))
    from gpuguard.hw.pcie_capture import replay_entries

    assert replay_entries(entries, str(dest)) == ["sys/devices/pci0000:00/0000:00:02.0/resource (ELOOP)"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("hello\n", "not a gpuguard pcie capture"),
        (f"{MAGIC}\nfile /etc/passwd\n| x\n", "must be relative"),
        (f"{MAGIC}\nfile sys/../../etc/passwd\n| x\n", "must be relative"),
        (f"{MAGIC}\nhex sys/a 4\n 0000: 01 02\n", "2 bytes of hex, header says 4"),
        (f"{MAGIC}\nhex sys/a 2\n 0010: 01 02\n", ":3: bad hex row"),
        (f"{MAGIC}\nlink sys/a\n", ":2: link without"),
        (f"{MAGIC}\nbogus sys/a\n", ":2: unknown entry"),
    ],
)
def test_bad_captures_are_named_by_line(text, message):
    with pytest.raises(CaptureError, match=message.replace("(", r"\(")):
        parse_capture(text, "x.pcie.txt")


def test_replay_refuses_links_out_of_the_tree(tmp_path):
    f = tmp_path / "evil.pcie.txt"
    f.write_text(f"{MAGIC}\nlink sys/bus/pci/devices/x -> ../../../../../../etc\n")
    with pytest.raises(CaptureError, match="outside the tree"):
        replay(str(f), str(tmp_path / "r"))


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_real_capture_replays_and_walks(path, tmp_path):
    dest = tmp_path / "tree"
    replay(str(path), str(dest))
    root = SysfsRoot(str(dest))
    rep = walk(root)
    n = len(rep.gpus)
    assert len(rep.pairs) == n * (n - 1) // 2  # every pair gets a verdict
    for g in rep.gpus:
        assert g.hops and g.hops[-1].bdf == g.bdf and g.hops[-1].role == "gpu"
        assert g.root_complex.startswith("pci")
    for p in rep.pairs:
        assert p.meet in ("switch", "root_port", "host_bridge") and p.verdict
    doc = json.loads(json.dumps(document(rep)))
    # Every device of the capture parses on its own too, links or not.
    every = walk(root, select=lambda *_: True)
    assert every.gpus, "a capture holds at least one PCI function"
    for g in every.gpus:
        assert g.hops[-1].bdf == g.bdf
    golden = path.with_name(path.name.replace(".pcie.txt", ".pcie.json"))
    if os.environ.get("GPUGUARD_REGEN"):
        golden.write_text(json.dumps(doc, indent=2) + "\n")
    # A missing golden is a failure, not a pass: a capture without one checks nothing.
    assert golden.exists(), f"{golden.name} missing: write it with GPUGUARD_REGEN=1 and review the diff"
    assert doc == json.loads(golden.read_text())


def test_vm_capture_has_no_gpu_and_no_link_attributes(tmp_path):
    """This machine (a VM with virtio devices): a real tree where the link attributes,
    PCIe capabilities and GPUs are all missing."""
    path = FIXTURES / "vm-virtio-nogpu.pcie.txt"
    dest = tmp_path / "tree"
    replay(str(path), str(dest))
    root = SysfsRoot(str(dest))
    assert walk(root).gpus == ()
    every = walk(root, select=lambda *_: True)
    assert len(every.gpus) == 6
    for g in every.gpus:
        assert len(g.hops) == 1  # on the root bus, no root port above
        assert g.narrowest is None and g.hops[0].current_speed_gts is None
        assert g.root_port_atomics is None and "no root port" in g.root_port_atomics_note
    virtio = every.gpu("0000:00:02.0")
    assert virtio.vendor == "1af4" and virtio.driver == "virtio-pci"
    cfg = parse_config(root.read_bytes("/sys/bus/pci/devices/0000:00:02.0/config"))
    assert cfg.has_pcie is False and cfg.vendor == "1af4"
    assert every.host_bridges == {"pci0000:00": "8086:0d57"}


def test_h200_capture(tmp_path):
    """The H200 test host (converted from tests/fixtures/h200/pci-sysfs.json): one H200
    passed through into a VM, straight on the root bus, no root port, no mem_info_*."""
    dest = tmp_path / "tree"
    replay(str(FIXTURES / "h200-vm.pcie.txt"), str(dest))
    rep = walk(SysfsRoot(str(dest)))
    assert [g.bdf for g in rep.gpus] == ["0000:00:06.0"]
    g = rep.gpus[0]
    assert (g.vendor, g.device, g.class_code, g.driver) == ("10de", "2335", "0x030200", "nvidia")
    assert [h.role for h in g.hops] == ["gpu"] and not g.hops[0].role_inferred  # config says endpoint
    link = g.narrowest_link
    assert (link.upper, link.current_speed_gts, link.current_width) == ("pci0000:00", 32.0, 16)
    assert not link.downgraded and g.bottleneck_bytes_per_second == pytest.approx(63.02e9, rel=1e-3)
    assert [(b.index, b.size_bytes) for b in g.bars] == [(0, 16 << 20), (2, 256 << 30), (4, 32 << 20)]
    assert g.large_bar is None and g.root_port_atomics is None and "root bus" in g.root_port_atomics_note
    assert rep.pairs == () and rep.host_bridges == {"pci0000:00": "8086:0d57"}
    # With VRAM from NVML (141 GiB on an H200) the 256 GiB BAR2 shows large BAR working.
    g = walk(SysfsRoot(str(dest)), vram={"0000:00:06.0": 150_754_820_096}).gpus[0]
    assert g.large_bar is True and "BAR2 256 GiB" in g.large_bar_note
