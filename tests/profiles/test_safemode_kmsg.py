import os
import time

import pytest

from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.profiles.kernel_reason import KmsgReasons
from gpuguard.profiles.safemode import SafeModeGuard

pytestmark = [pytest.mark.root]  # registered in pyproject.toml


def host(tmp_path, boot="boot-1", cmdline="quiet splash"):
    (tmp_path / "root/proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (tmp_path / "root/proc/sys/kernel/random/boot_id").write_text(boot + "\n")
    (tmp_path / "root/proc/cmdline").write_text(cmdline + "\n")
    return SysfsRoot(str(tmp_path / "root"))


def boot(tmp_path, boot_id, cmdline="quiet", now=1000.0):
    g = SafeModeGuard(str(tmp_path / "state"), host(tmp_path, boot_id, cmdline), window=300, threshold=2, clock=lambda: now)
    return g, g.decide()


def test_two_crashes_after_apply_enter_safe_mode_until_cleared(tmp_path):
    g, d = boot(tmp_path, "b1")
    assert not d.safe
    g.record_apply()  # ...and the host dies (no clean stop, no heartbeat past the window)
    g, d = boot(tmp_path, "b2")
    assert not d.safe  # one crash is not yet a pattern
    g.record_apply()
    g, d = boot(tmp_path, "b3")
    assert d.safe and "2 starts in a row" in d.reason
    g, d = boot(tmp_path, "b4")
    assert d.safe  # sticky
    g.clear()
    g, d = boot(tmp_path, "b5")
    assert not d.safe


def test_clean_stop_or_survived_window_breaks_the_streak(tmp_path):
    g, _ = boot(tmp_path, "b1")
    g.record_apply()
    g, _ = boot(tmp_path, "b2")  # crash 1
    g.record_apply()
    g.record_clean_stop()
    g, d = boot(tmp_path, "b3")
    assert not d.safe
    g.record_apply()
    g.clock = lambda: 1000.0 + 301
    g.heartbeat()
    g, d = boot(tmp_path, "b4")
    assert not d.safe


def test_daemon_restart_without_reboot_is_not_a_host_crash(tmp_path):
    g, _ = boot(tmp_path, "same")
    g.record_apply()
    g, _ = boot(tmp_path, "same")
    g.record_apply()
    _, d = boot(tmp_path, "same")
    assert not d.safe


def test_kernel_command_line_word_forces_safe_mode(tmp_path):
    _, d = boot(tmp_path, "b1", cmdline="root=/dev/sda1 gpuguard.safe quiet")
    assert d.safe and "gpuguard.safe" in d.reason
    _, d = boot(tmp_path, "b2", cmdline="root=/dev/sda1 gpuguard.safety quiet")
    assert not d.safe


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: writing /dev/kmsg")
def test_reason_read_from_real_dev_kmsg():
    """Writes a record into the real kernel log and reads it back by PCI address."""
    if not os.access("/dev/kmsg", os.R_OK | os.W_OK):
        pytest.skip("/dev/kmsg not readable and writable here")
    r = KmsgReasons(SysfsRoot("/"))
    since = r.mark()
    bdf = "0000:%02x:00.0" % (os.getpid() % 200 + 40)
    with open("/dev/kmsg", "w") as f:
        f.write(f"amdgpu {bdf}: amdgpu: Voltage offset (50) must be within [-200, 0]!\n")
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        got = r(bdf, since)
    assert got and "Voltage offset (50) must be within [-200, 0]!" in got
    assert r("0000:ff:1f.7", since) is None
    assert r(bdf, r.mark()) is None  # nothing newer than the mark
