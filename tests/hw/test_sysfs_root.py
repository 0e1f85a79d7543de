"""SysfsRoot: where a relative path lands, and that reading leaves nothing behind.

The PCIe walk reads thousands of distinct files once a minute (about 3 800 at 32 GPUs);
a per-path cache of joined paths held every one of them for the daemon's life: 0.7 MiB of
its RSS at 32 GPUs (issue 15)."""
from __future__ import annotations

import gc
import os
import tracemalloc

import pytest

from gpuguard.hw import sysfs
from gpuguard.hw.sysfs import SysfsError, SysfsRoot


@pytest.fixture
def tree(tmp_path):
    d = tmp_path / "sys" / "bus" / "pci" / "devices"
    d.mkdir(parents=True)
    for i in range(2000):
        (d / f"f{i:04d}").write_bytes(b"0x%04x\n" % i)
    return tmp_path


@pytest.mark.parametrize("rel", ["sys/bus/pci/devices/f0007", "/sys/bus/pci/devices/f0007"])
def test_a_leading_slash_is_optional_and_the_file_is_the_one_below_the_root(tree, rel):
    assert SysfsRoot(str(tree)).read_bytes(rel) == b"0x0007\n"
    assert SysfsRoot(str(tree) + "/").read_int(rel) == 7


def test_the_root_slash_reads_the_host_path(tree):
    path = str(tree / "sys" / "bus" / "pci" / "devices" / "f0009")
    assert SysfsRoot("/").read_bytes(path) == b"0x0009\n"


def test_a_missing_file_is_an_error_naming_the_file_as_given(tree):
    with pytest.raises(SysfsError) as e:
        SysfsRoot(str(tree)).read_bytes("/sys/bus/pci/devices/nope")
    assert "/sys/bus/pci/devices/nope" in str(e.value)


def test_reading_many_distinct_files_keeps_nothing_per_file(tree):
    root = SysfsRoot(str(tree))
    rels = [f"/sys/bus/pci/devices/f{i:04d}" for i in range(2000)]
    root.read_bytes(rels[0])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for rel in rels:
            root.read_bytes(rel)
        del rel
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(s.size_diff for s in after.compare_to(before, "filename")
               if s.traceback[0].filename == sysfs.__file__)
    # 2 000 joined paths held would be about 300 KiB
    assert kept < 4096, f"SysfsRoot kept {kept} bytes after reading {len(rels)} files once"
    assert not any(isinstance(v, dict) and len(v) > 10 for v in vars(root).values())


def test_the_read_path_is_the_join_of_root_and_path(tree):
    root = SysfsRoot(str(tree))
    for rel in ("sys/bus/pci/devices/f0001", "/sys/bus/pci/devices/f0001", "//sys/bus/pci/devices/f0001"):
        assert root.path(rel) == os.path.join(str(tree), "sys/bus/pci/devices/f0001")
