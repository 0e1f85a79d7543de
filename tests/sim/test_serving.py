"""The simulated host served to real processes: a FUSE mount (real syscalls, real errno,
real symlinks), a plain directory tree, and the control socket of a separate process."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.sim.control import ControlError, ControlServer, send
from gpuguard.sim.fuse import fuse_available, mount
from gpuguard.sim.host import SimHost
from gpuguard.sim.tree import write_tree
from support import poll_until

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]
XTX = "0000:aa:00.0"
R9700 = "0000:05:00.0"

_reason = fuse_available()
needs_fuse = pytest.mark.skipif(os.geteuid() != 0 or _reason is not None,
                                reason=f"needs root and FUSE: {_reason or 'not root'}")


def wait_for(cond, timeout=10.0, what="condition"):
    return poll_until(cond, timeout, what)


def syscall_errno(fn) -> int:
    with pytest.raises(OSError) as ei:
        fn()
    return ei.value.errno


def os_write(path, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)


def os_read(path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


@needs_fuse
def test_fuse_errno_through_real_syscalls(tmp_path):
    h = SimHost.incident(seed=1)
    with mount(h, str(tmp_path / "mnt")) as mp:
        card = mp + h.card_path(R9700)
        od = f"{card}/device/pp_od_clk_voltage"
        assert os.path.islink(card)
        assert os.path.realpath(card) == mp + h.device_path(R9700) + "/drm/" + card.rsplit("/", 1)[1]
        assert os_read(od) == h.read(h.card_path(R9700) + "/device/pp_od_clk_voltage")
        assert os_write(od, b"s -500\n") == 7
        assert syscall_errno(lambda: os_write(od, b"vo 50\n")) == errno.EINVAL
        assert h.kernel_log.records[-1].text.endswith("Voltage offset (50) must be within [-200, 0]!")
        assert syscall_errno(lambda: os_write(f"{card}/device/vendor", b"1")) == errno.EACCES
        assert syscall_errno(lambda: os_read(f"{card}/device/nonexistent")) == errno.ENOENT
        cap = mp + h.hwmon_path(R9700) + "/power1_cap"
        assert syscall_errno(lambda: os_write(cap, b"5000000000")) == errno.ERANGE
        # shell-style `echo c > file` (O_TRUNC) works like on sysfs
        with open(od, "w") as f:
            f.write("c\n")
        assert h.gpu(R9700).od.active["sclk_offset"] == -500
        # The daemon's own reader works against the mount.
        root = SysfsRoot(mp)
        assert root.read_text(h.card_path(XTX) + "/device/vbios_version") == "113-D70401XT-N11"
        # lost GPU: EIO first, then an fd opened before removal reads ENODEV, new opens ENOENT
        busy = mp + h.device_path(XTX) + "/gpu_busy_percent"
        xtx_card = mp + h.card_path(XTX)
        fd = os.open(busy, os.O_RDONLY)
        h.lose_gpu(XTX)
        assert syscall_errno(lambda: os.pread(fd, 100, 0)) == errno.EIO
        h.step(0.5)
        assert syscall_errno(lambda: os.pread(fd, 100, 0)) == errno.ENODEV
        os.close(fd)
        assert syscall_errno(lambda: os_read(busy)) == errno.ENOENT
        assert not os.path.lexists(xtx_card)
        with pytest.raises(SysfsError) as se:
            root.read_text(h.device_path(XTX) + "/uevent")
        assert se.value.gone
        # runtime suspend: EPERM on 6.14 through a real read
        h.suspend("0000:08:00.0")
        assert syscall_errno(lambda: os_read(mp + h.device_path("0000:08:00.0") + "/gpu_busy_percent")) == errno.EPERM
    assert not os.path.ismount(str(tmp_path / "mnt"))


@needs_fuse
def test_fuse_blocked_read_and_clean_unmount(tmp_path):
    import threading
    h = SimHost.incident(seed=1)
    with mount(h, str(tmp_path / "mnt")) as mp:
        path = mp + h.hwmon_path(XTX) + "/power1_average"
        h.block(XTX, "power1_average")
        got = []
        t = threading.Thread(target=lambda: got.append(os_read(path)), daemon=True)
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got
        assert os_read(mp + h.hwmon_path(XTX) + "/temp1_input")      # others still answer
        h.unblock(XTX)
        t.join(5)
        assert got and got[0].strip().isdigit()


def walk(root: str) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in list(dirnames):
            p = os.path.join(dirpath, d)
            if os.path.islink(p):
                out[os.path.join(rel, d)] = ("link", os.readlink(p))
                dirnames.remove(d)
        for f in filenames:
            p = os.path.join(dirpath, f)
            if os.path.islink(p):
                out[os.path.join(rel, f)] = ("link", os.readlink(p))
            else:
                out[os.path.join(rel, f)] = ("file", os_read(p))
    return out


@needs_fuse
def test_plain_tree_matches_fuse_view(tmp_path):
    h = SimHost.incident(seed=9)
    h.set_load(R9700, 0.8)
    h.step(1.0)
    write_tree(h, str(tmp_path / "tree"))
    with mount(h, str(tmp_path / "mnt")) as mp:
        fuse_view = walk(mp)
    tree_view = walk(str(tmp_path / "tree"))
    assert len(fuse_view) > 800
    assert fuse_view.keys() == tree_view.keys()
    diff = [k for k in fuse_view if fuse_view[k] != tree_view[k]]
    assert diff == []


def test_plain_tree_refresh_feeds_writes_and_follows_faults(tmp_path):
    h = SimHost.incident(seed=3)
    root = tmp_path / "tree"
    w = write_tree(h, str(root))
    od = root / h.device_path(R9700).lstrip("/") / "pp_od_clk_voltage"
    power = root / h.hwmon_path(R9700).lstrip("/") / "power1_average"
    idle = power.read_bytes()
    h.set_load(R9700, 1.0)
    for _ in range(10):
        h.step(0.5)
    assert w.refresh() > 0
    assert int(power.read_bytes()) > int(idle)
    od.write_bytes(b"s -500\n")                       # a daemon's write lands in a plain file
    w.refresh()
    assert h.gpu(R9700).od.staged["sclk_offset"] == -500
    assert b"OD_SCLK_OFFSET:\n-500Mhz" in od.read_bytes()
    od.write_bytes(b"vo 50\n")                        # refused: reverted, reason in the log
    w.refresh()
    assert b"OD_VDDGFX_OFFSET:\n0mV" in od.read_bytes()
    assert h.kernel_log.records[-1].text.endswith("must be within [-200, 0]!")
    assert not list(root.rglob("*.tmp"))              # atomic replace leaves nothing behind
    card = root / h.card_path(XTX).lstrip("/")
    assert card.is_symlink() and (card / "device" / "vendor").read_bytes() == b"0x1002\n"
    h.lose_gpu(XTX)
    h.step(0.5)
    w.refresh()
    assert not os.path.lexists(card)
    assert not (root / h.device_path(XTX).lstrip("/")).exists()
    h.add_late_gpu(R9700)
    w.refresh()
    assert not od.exists()
    h.appear(R9700)
    w.refresh()
    assert od.exists()


def test_control_socket_in_process(tmp_path):
    h = SimHost.incident(seed=1)
    sock = str(tmp_path / "ctl.sock")
    srv = ControlServer(h, sock).start()
    try:
        send(sock, "set_load", bdf=R9700, level=1.0)
        send(sock, "step", dt=2.0)
        st = send(sock, "state")
        assert st["gpus"][R9700]["load"] == 1.0 and st["gpus"][R9700]["power_w"] > 100
        with pytest.raises(ControlError, match="EINVAL|Invalid argument"):
            send(sock, "write", path=h.device_path(R9700) + "/pp_od_clk_voltage", data="vo 50\n")
        lines = send(sock, "kernel_log", since=0)
        assert any("Voltage offset (50)" in ln for ln in lines)
        with pytest.raises(ControlError, match="unknown op"):
            send(sock, "unbind", bdf=R9700)
        send(sock, "lose_gpu", bdf=XTX, err="ENODEV")
        send(sock, "step", dt=0.5)
        assert XTX not in send(sock, "gpus")
    finally:
        srv.stop()


@needs_fuse
def test_fuse_as_separate_process_with_control(tmp_path):
    mp, sock = str(tmp_path / "mnt"), str(tmp_path / "ctl.sock")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.sim.fuse", mp, "--control", sock,
                             "--step-interval", "0.1", "--seed", "5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: os.path.ismount(mp) and os.path.exists(sock), what="mount and control socket")
        st = send(sock, "state")
        card = f"/sys/class/drm/card{st['gpus'][R9700]['card']}"
        hw = f"{mp}{card}/device/hwmon/hwmon{st['gpus'][R9700]['hwmon']}/power1_average"
        idle = int(os_read(hw))
        send(sock, "set_load", bdf=R9700, level=1.0)
        wait_for(lambda: int(os_read(hw)) > idle + 80_000_000, what="power to rise under load")
        xtx_card = f"{mp}/sys/class/drm/card{st['gpus'][XTX]['card']}"
        send(sock, "lose_gpu", bdf=XTX)
        wait_for(lambda: not os.path.lexists(xtx_card), what="lost GPU to vanish")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert not os.path.ismount(mp)
    assert b"Traceback" not in err


@needs_fuse
def test_fuse_non_root_writer_gets_eacces():
    import tempfile
    h = SimHost.incident(seed=1)
    mnt = tempfile.mkdtemp(prefix="gpuguard-sim-")   # pytest's tmp_path is 0700: nobody can't enter
    os.chmod(mnt, 0o755)
    with mount(h, mnt) as mp:
        od = mp + h.device_path(R9700) + "/pp_od_clk_voltage"
        busy = mp + h.device_path(R9700) + "/gpu_busy_percent"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                        # child: drop to nobody, read, try to write
            code = 1
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                reading = os_read(busy).strip().decode()
                try:
                    os.close(os.open(od, os.O_WRONLY))
                    result = "opened"
                except OSError as e:
                    result = str(e.errno)
                os.write(w, f"{reading} {result}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        out = os.read(r, 100).decode()
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        reading, opened = out.split()
        assert reading.isdigit()
        assert int(opened) == errno.EACCES
    os.rmdir(mnt)


def test_tree_as_separate_process_without_fuse(tmp_path):
    root, sock = tmp_path / "tree", str(tmp_path / "ctl.sock")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.sim.tree", str(root), "--control", sock,
                             "--step-interval", "0.1", "--scenario", "incident-late"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: os.path.exists(sock), what="control socket")
        assert "0000:08:00.0" not in send(sock, "gpus")
        assert not (root / "sys/bus/pci/devices/0000:08:00.0").exists()
        wait_for(lambda: (root / "sys/bus/pci/devices/0000:08:00.0/vendor").exists(), timeout=15,
                 what="the late GPU in the plain tree")
        st = send(sock, "state")["gpus"]["0000:08:00.0"]
        # the writer makes the card's drm link after the PCI files: wait on the very file read
        device = root / f"sys/class/drm/card{st['card']}/device/device"
        wait_for(device.exists, timeout=15, what=f"{device} in the plain tree")
        assert device.read_bytes() == b"0x7551\n"
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"Traceback" not in err


def test_without_libfuse_the_module_imports_and_names_why_it_cannot_mount(tmp_path):
    # mfusepy loads libfuse at import; FUSE_LIBRARY_NAME=none stands in for a host without it.
    # The suite on such a host must skip FUSE tests with this reason, not stop at collection.
    code = ("from gpuguard.sim.fuse import fuse_available, mount\n"
            "from gpuguard.sim.host import SimHost\n"
            "print(fuse_available())\n"
            "try:\n"
            f"    with mount(SimHost(), {str(tmp_path / 'mnt')!r}): pass\n"
            "except RuntimeError as e: print('refused:', e)\n")
    env = dict(os.environ, FUSE_LIBRARY_NAME="none", PYTHONPATH=str(REPO / "daemon"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    reason, refused = r.stdout.splitlines()
    assert reason.startswith("libfuse cannot be loaded") and "fuse3" in reason
    assert refused == f"refused: cannot mount the simulated host: {reason}"


@needs_fuse
def test_sim_mount_records_writes_in_order_with_errno_and_serves_extra_files_read_only(tmp_path):
    """The test mount (`SimMount`): a recorder of what reached the model — the accepted
    write, then the refused one with the kernel's EINVAL — and files beside the tree whose
    callables are rendered at every read, so a log read through one fd sees later lines."""
    from gpuguard.sim.fuse import SimMount

    host = SimHost.incident()
    log = [b"first\n"]
    m = SimMount(host, str(tmp_path / "m"), extra={"/proc/cmdline": b"root=/dev/sda1\n",
                                                   "/dev/kmsg": lambda: b"".join(log)}, record=True)
    try:
        od = tmp_path / "m" / "sys/bus/pci/devices" / R9700 / "pp_od_clk_voltage"
        fd = os.open(od, os.O_WRONLY)   # one write() each (a buffered file retries at close)
        try:
            assert os.write(fd, b"s -500\n") == 7
            assert syscall_errno(lambda: os.write(fd, b"s -9999\n")) == errno.EINVAL
        finally:
            os.close(fd)
        assert m.writes() == ["pp_od_clk_voltage: s -500"]
        assert m.writes(ok_only=False) == ["pp_od_clk_voltage: s -500", "pp_od_clk_voltage: s -9999"]
        assert [e for _, _, e in m.recorder.writes] == [0, errno.EINVAL]
        assert m.writes_by_gpu() == {R9700: ["pp_od_clk_voltage: s -500"]}
        assert [p.endswith(f"{R9700}/pp_od_clk_voltage") for _, p, _ in m.recorder.write_starts] == [True, True]
        before = m.recorder.reads.get(f"{R9700}/pp_od_clk_voltage", 0)
        od.read_text()
        assert m.recorder.reads[f"{R9700}/pp_od_clk_voltage"] == before + 1

        assert (tmp_path / "m/proc/cmdline").read_text() == "root=/dev/sda1\n"
        assert sorted(os.listdir(tmp_path / "m")) == ["dev", "proc", "sys"]
        assert syscall_errno(lambda: (tmp_path / "m/proc/cmdline").write_text("x")) == errno.EACCES
        with open(tmp_path / "m/dev/kmsg", "rb") as f:
            assert f.read() == b"first\n"
            log.append(b"second\n")
            assert f.read() == b"second\n"   # same fd, the line appended since
    finally:
        m.close()
    assert not os.path.ismount(tmp_path / "m")
