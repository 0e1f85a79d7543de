"""A held sysfs attribute (hw/sysfs.HeldAttribute): one `pread` at offset 0 a read where
open/read/close cost three (issue 15: the power sampler reads every GPU 20 times a second).
It must read what a fresh open would read — on the real kernel's sysfs, on the FUSE
simulator, and on a tree of plain files replaced by rename — and name the file when it
cannot."""
from __future__ import annotations

import errno
import os
import socket

import pytest

from gpuguard.hw.sysfs import HeldAttribute, SysfsError, SysfsRoot, filesystem_type

LO_TX = "/sys/class/net/lo/statistics/tx_bytes"


def test_on_the_real_kernel_sysfs_every_read_renders_the_attribute_anew():
    if not os.path.exists(LO_TX):
        pytest.skip(f"{LO_TX} is not here (no sysfs or no loopback device)")
    held = SysfsRoot("/").held(LO_TX)
    assert held.rerenders, "sysfs must be known as a filesystem that renders every read at offset 0"
    try:
        before = int(held.read())
        # datagrams over loopback: each is transmitted at once, the counter must go up
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            rx.bind(("127.0.0.1", 0))
            for _ in range(100):
                tx.sendto(b"x" * 1000, rx.getsockname())
        after = int(held.read())
    finally:
        held.close()
    assert after >= before + 100_000


def test_a_plain_file_replaced_by_rename_is_read_anew(tmp_path):
    (tmp_path / "power1_average").write_text("100000000\n")
    held = SysfsRoot(str(tmp_path)).held("power1_average")
    assert not held.rerenders  # ext4/tmpfs/overlay: the held fd would keep the old inode
    try:
        assert held.read() == b"100000000\n"
        tmp = tmp_path / ".new"
        tmp.write_text("250000000\n")
        os.replace(tmp, tmp_path / "power1_average")  # what `gpuguard demo --write-tree` does
        assert held.read() == b"250000000\n"
        assert held.read() == b"250000000\n"
    finally:
        held.close()


def test_a_vanished_file_is_a_named_error_and_a_returning_one_is_read_again(tmp_path):
    f = tmp_path / "power1_average"
    f.write_text("1\n")
    held = SysfsRoot(str(tmp_path)).held("power1_average")
    try:
        assert held.read() == b"1\n"
        f.unlink()
        with pytest.raises(SysfsError) as e:
            held.read()
        assert e.value.errno == errno.ENOENT and e.value.path == "power1_average" and e.value.gone
        f.write_text("2\n")
        assert held.read() == b"2\n"
    finally:
        held.close()


def test_close_lets_go_of_the_file(tmp_path):
    (tmp_path / "a").write_text("1\n")
    held = SysfsRoot(str(tmp_path)).held("a")
    held.read()
    fd = held._fd
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}").endswith("/a")
    held.close()
    held.close()  # twice is fine
    assert held._fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
27 1 8:1 / / rw,relatime - ext4 /dev/root rw
90 27 0:50 / /tmp/sim\\040root rw,nosuid,nodev,relatime - fuse.python3 sim rw,user_id=0,group_id=0
"""


@pytest.mark.parametrize("path, kind", [
    ("/sys/class/hwmon/hwmon0/power1_average", "sysfs"),
    ("/sys/fs/cgroup/cpu", "tmpfs"),           # the deepest mount wins
    ("/proc/self/stat", "proc"),
    ("/home/x", "ext4"),
    ("/tmp/sim root/sys/class/drm", "fuse"),   # \\040 is a space; any FUSE filesystem is "fuse"
    ("/tmp/sim rootless/x", "ext4"),           # a prefix of a name is not its mount
])
def test_filesystem_type_reads_the_mount_table(tmp_path, path, kind, monkeypatch):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    monkeypatch.setattr(os.path, "realpath", lambda p: p)  # the paths above need not exist here
    assert filesystem_type(path, str(info)) == kind


def test_filesystem_type_is_empty_when_the_mount_table_cannot_be_read(tmp_path):
    assert filesystem_type("/sys", str(tmp_path / "missing")) == ""


@pytest.mark.fuse
@pytest.mark.root
def test_on_the_fuse_simulator_a_held_attribute_follows_the_model(tmp_path):
    """The simulator serves kernfs semantics (sim/fuse.py): a held power1_average reads the
    model's value of now at every read, through the one fd; a lost card is EIO, then gone."""
    if os.geteuid() != 0:
        pytest.skip("FUSE mount of the simulator needs root")
    from gpuguard.sim.fuse import SimMount, fuse_available
    from gpuguard.sim.host import SimHost

    why = fuse_available()
    if why:
        pytest.skip(why)
    host = SimHost.incident(seed=3, xtx=False)
    bdf = "0000:05:00.0"
    path = f"{host.hwmon_path(bdf)}/power1_average"
    (tmp_path / "m").mkdir()
    m = SimMount(host, str(tmp_path / "m"))
    try:
        held = SysfsRoot(str(tmp_path / "m")).held(path)
        assert held.rerenders
        seen = []
        for load in (0.0, 1.0, 0.2):
            host.set_load(bdf, load)
            for _ in range(4):
                host.step(0.5)
            got = held.read()
            assert got == host.read(path), load
            seen.append(int(got))
        assert len(set(seen)) == 3 and seen[1] > seen[0]
        host.lose_gpu(bdf)  # first EIO from the dying card, then its directories go
        with pytest.raises(SysfsError) as e:
            held.read()
        assert e.value.errno == errno.EIO and held._fd is None
        host.step(0.5)
        with pytest.raises(SysfsError) as e:
            held.read()
        assert e.value.gone and e.value.path == path
    finally:
        held.close()
        m.close()
