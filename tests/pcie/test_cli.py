"""`gpuguard pcie` and `gpuguard doctor` run as real subprocesses against built trees:
the tree output marks the narrowest hop, colour only on a real terminal (a pty), JSON for
scripts, capture/replay through the CLI, doctor's exit status."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from gpuguard.hw.pcie_config import build_config
import pytest

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "daemon"), "PYTHONIOENCODING": "utf-8"}
ENV.pop("NO_COLOR", None)
XTX = ("0000:aa:00.0", "0000:b0:00.0")


def gg(*args, check_rc=None):
    p = subprocess.run([sys.executable, "-m", "gpuguard.cli", *args], env=ENV, capture_output=True,
                       text=True, timeout=60)
    if check_rc is not None:
        assert p.returncode == check_rc, p.stdout + p.stderr
    return p


def test_pcie_tree_marks_the_narrowest_downgraded_hop(incident):
    p = gg("pcie", "--sysfs-root", str(incident.base), "--busy", check_rc=0)
    out = p.stdout
    assert "\033[" not in out  # not a terminal: no colour codes
    block = out.split("GPU 0000:aa:00.0", 1)[1].split("\n\n", 1)[0]
    lines = block.splitlines()
    marked = [ln for ln in lines if "NARROWEST" in ln]
    assert len(marked) == 1
    assert "0000:a8:00.0" in marked[0] and "card upstream" in marked[0]
    assert "5.0/16.0 GT/s x16/x16" in marked[0] and "8.00 GB/s" in marked[0]
    assert "DOWNGRADED: both ends can 16.0 GT/s x16" in marked[0]
    # Root port first, GPU last, the internal ports shown as such.
    assert lines[2].split()[:3] == ["0000:a0:02.0", "root", "port"]
    assert lines[-1].lstrip("└─` ").split()[:2] == ["0000:aa:00.0", "GPU"]
    assert any("0000:a3:00.0" in ln and "mirror values" in ln for ln in lines)
    r9700 = out.split("GPU 0000:05:00.0", 1)[1].split("\n\n", 1)[0]
    assert "◀ NARROWEST, limited by 0000:00:02.0" in r9700
    assert "meet under switch 0000:a1:00.0 (1000:c010)" in out
    assert "large BAR not active: CPU sees 256 MiB of 24 GiB VRAM" in out


def _run_in_pty(args, timeout=60):
    pid, fd = pty.fork()
    if pid == 0:  # child
        os.execve(sys.executable, [sys.executable, "-m", "gpuguard.cli", *args], ENV)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 1.0)
        if r:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode("utf-8", "replace")


def test_colour_on_a_terminal(incident):
    rc, out = _run_in_pty(["pcie", "--sysfs-root", str(incident.base), "--busy"])
    assert rc == 0
    marked = [ln for ln in out.splitlines() if "NARROWEST" in ln and "a8:00.0" in ln]
    assert marked and "\033[1;33m" in marked[0] and "\033[1;31mDOWNGRADED" in marked[0]


def test_json_is_the_report(incident):
    doc = json.loads(gg("pcie", "--json", "--sysfs-root", str(incident.base), "--busy", check_rc=0).stdout)
    assert doc["schema"] == 1
    g = {x["bdf"]: x for x in doc["gpus"]}[XTX[0]]
    assert g["narrowest"]["lower"] == "0000:a8:00.0"
    assert g["narrowest"]["bytes_per_second"] == 8e9
    assert [h["narrowest"] for h in g["hops"]].count(True) == 1
    assert g["large_bar"] is False
    pair = [p for p in doc["pairs"] if {p["a"], p["b"]} == set(XTX)][0]
    assert pair["meet"] == "switch"


def test_capture_and_replay_through_the_cli(incident, tmp_path):
    out = tmp_path / "host.pcie.txt"
    p = gg("pcie", "--sysfs-root", str(incident.base), "--capture", str(out), check_rc=0)
    assert "wrote" in p.stdout and out.read_text().startswith("# gpuguard pcie capture v1")
    a = json.loads(gg("pcie", "--json", "--sysfs-root", str(incident.base), check_rc=0).stdout)
    b = json.loads(gg("pcie", "--json", "--replay", str(out), check_rc=0).stdout)
    assert a == b
    bad = tmp_path / "bad.pcie.txt"
    bad.write_text("nope\n")
    p = gg("pcie", "--replay", str(bad), check_rc=1)
    assert "bad.pcie.txt:1: not a gpuguard pcie capture" in p.stderr and "Traceback" not in p.stderr


def healthy_host(tree):
    """One NVIDIA datacenter GPU (class 0x0302 "3D controller") on a Gen5 root port."""
    tree.add("0000:00:00.0", "pci0000:00", "8086:09a2", 0x060000)
    tree.add("0000:00:01.0", "pci0000:00", "8086:352a", 0x060400, port="root_port", cur=(32.0, 16),
             max=(32.0, 16), devcap2=0x3C0, driver="pcieport",
             files={"aer_dev_correctable": "RxErr 0\nTOTAL_ERR_COR 0\n"})
    bars = {0: (0xa0000000, 16 << 20, 0x40200), 1: (0x20000000000, 256 << 30, 0x14220C),
            3: (0x24000000000, 32 << 20, 0x14220C)}
    res = "".join(f"0x{s:016x} 0x{s + n - 1:016x} 0x{f:016x}\n" for s, n, f in (bars.get(i, (0, 1, 0)) for i in range(6)))
    tree.add("0000:01:00.0", "0000:00:01.0", "10de:2335", 0x030200, port="endpoint", cur=(32.0, 16),
             max=(32.0, 16), driver="nvidia", files={"resource": res})
    return tree


def test_doctor_exit_status(incident, make_tree, tmp_path):
    pci_tree = make_tree()
    p = gg("doctor", "--sysfs-root", str(incident.base), "--busy")
    assert p.returncode == 2
    fails = [ln for ln in p.stdout.splitlines() if ln.startswith("FAIL")]
    assert any("a7:00.0→a8:00.0" in ln for ln in fails)
    assert p.stdout.strip().splitlines()[-1].startswith("2 FAIL")
    healthy_host(pci_tree)
    p = gg("doctor", "--sysfs-root", str(pci_tree.base), check_rc=0)
    assert "63.02 GB/s at 00:01.0→01:00.0" in p.stdout
    assert "BAR1 256 GiB" in p.stdout and "large BAR unknown" in p.stdout  # NVIDIA: no mem_info_*
    assert not [ln for ln in p.stdout.splitlines() if ln.startswith(("WARN", "FAIL"))]
    # An expected link the GPU does not meet makes it fail.
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text("gpus:\n  - name: h\n    match: {bdf: '0000:01:00.0'}\n    expect_link: {gen: 6, width: 16}\n")
    p = gg("doctor", "--sysfs-root", str(pci_tree.base), "--config", str(cfg), check_rc=2)
    assert "expected 64.0 GT/s x16, link is capable of only 32.0 GT/s" in p.stdout
    cfg.write_text("gpus:\n  - name: h\n    match: {bdf: '0000:01:00.0'}\n    expect_link: {gen: 'four'}\n")
    p = gg("doctor", "--sysfs-root", str(pci_tree.base), "--config", str(cfg), check_rc=2)
    assert "gpus[0].expect_link.gen" in p.stderr and "Traceback" not in p.stderr
    doc = json.loads(gg("doctor", "--json", "--sysfs-root", str(pci_tree.base), check_rc=0).stdout)
    assert doc["status"] == 0 and {f["check"] for f in doc["findings"]} >= {"narrowest", "atomics", "bar", "aer"}


def test_doctor_on_a_config_space_without_root(pci_tree):
    healthy_host(pci_tree)
    cfg = pci_tree.paths["0000:00:01.0"] / "config"
    cfg.write_bytes(build_config(0x8086, 0x352a, 0x060400, size=64))
    p = gg("doctor", "--sysfs-root", str(pci_tree.base), check_rc=1)
    assert "unknown (needs root)" in p.stdout


GOLDEN = REPO / "tests" / "fixtures" / "pcie" / "incident-host.golden"


def test_incident_host_output_matches_golden(incident):
    """The whole `gpuguard pcie` + `doctor` output for the INCIDENTS §4 host, reviewed as a
    diff; GPUGUARD_REGEN=1 rewrites it."""
    pcie = gg("pcie", "--sysfs-root", str(incident.base), "--busy", check_rc=0).stdout
    doctor = gg("doctor", "--sysfs-root", str(incident.base), "--busy", check_rc=2).stdout
    text = "$ gpuguard pcie --busy\n" + pcie + "\n$ gpuguard doctor --busy\n" + doctor
    if os.environ.get("GPUGUARD_REGEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
