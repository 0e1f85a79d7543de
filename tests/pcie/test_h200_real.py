"""The real NVIDIA H200 host (issue 3/7): `gpuguard pcie --capture` was run there, and
so were `gpuguard pcie` and `gpuguard doctor`; their outputs are kept in
tests/fixtures/h200/. Replaying the capture must reproduce what the real host printed,
byte for byte: the walker handles a GPU on the root bus of a VM (no root port, no AER
files, no mem_info_*) without guessing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.hw.pcie_capture import replay

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURE = FIX / "pcie" / "h200-real.pcie.txt"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("h200")
    replay(str(CAPTURE), str(d))
    return d


@pytest.mark.parametrize("command, kept, status", [("pcie", "pcie.txt", 0), ("doctor", "doctor.txt", 1)])
def test_replay_prints_what_the_real_host_printed(tree, command, kept, status):
    r = subprocess.run([sys.executable, "-m", "gpuguard", command, "--sysfs-root", str(tree)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == status, r.stderr
    assert r.stdout == (FIX / "h200" / kept).read_text()


def test_real_h200_facts(tree):
    from gpuguard.hw.pcie import walk
    from gpuguard.hw.sysfs import SysfsRoot

    report = walk(SysfsRoot(str(tree)))
    (g,) = report.gpus
    assert g.bdf == "0000:00:06.0"
    # Gen5 x16 on the GPU's own link (no root port in this VM): 32 GT/s x 16 lanes x
    # 128/130 / 8 bits = 63.015 GB/s per direction, derived by hand, not by the walk
    link = g.narrowest_link
    assert (link.upper, link.lower) == ("pci0000:00", "0000:00:06.0")
    assert (link.current_speed_gts, link.current_width) == (32.0, 16)
    assert (link.capable_speed_gts, link.capable_width) == (32.0, 16)
    assert not link.downgraded_speed and not link.downgraded_width
    assert g.bottleneck_bytes_per_second == pytest.approx(32e9 * 16 * 128 / 130 / 8)
    assert report.pairs == ()
