"""Discovery and read_gpu on small real sysfs trees built from reference dumps: PCI class +
driver, hwmon by name, sensors by label, values per field, faults (garbage, EISDIR, hwmon
renumbered, device gone mid-read, runtime-suspended, OD disabled)."""
from __future__ import annotations

import os
import shutil

import pytest

from gpuguard.hw.amdgpu import discover, discover_one, read_gpu
from gpuguard.hw.sysfs import SysfsRoot

XTX = "rdna3-rx7900xtx-nitro-e471"
R9070 = "rdna4-rx9070"
N6600XT = "rdna2-rx6600xt"  # captured without pp_od_clk_voltage (OD not enabled)


class RecordingRoot(SysfsRoot):
    """A real SysfsRoot that records each file read and can run a hook before the Nth
    read (to make the device vanish mid-poll with real filesystem errors)."""

    def __init__(self, root, before_read=None):
        super().__init__(root)
        self.reads: list[str] = []
        self.before_read = before_read

    def read_bytes(self, rel):
        if self.before_read:
            self.before_read(len(self.reads), rel)
        self.reads.append(rel)
        return super().read_bytes(rel)


@pytest.fixture
def incident_host(host):
    """Two amdgpu GPUs (XTX hwmon5/card0 on 03:00.0, RX 9070 hwmon2/card1 on 08:00.0 —
    index order deliberately not PCI order), an OD-less RX 6600 XT, and devices that
    must not be picked: a bridge, a card on the radeon driver, an NVIDIA GPU, AMD HDMI audio."""
    host.add_gpu(XTX, "0000:03:00.0", hwmon=5, card=0)
    host.add_gpu(R9070, "0000:08:00.0", hwmon=2, card=1)
    host.add_gpu(N6600XT, "0000:0b:00.0", hwmon=4, card=2)
    host.add_gpu("gcn1-hd7870-radeon", "0000:01:00.0", driver="radeon", card=3)
    host.add_other("0000:00:01.0", "0x060400", "0x8086", "0x6f02", "pcieport")
    host.add_other("0000:02:00.0", "0x030000", "0x10de", "0x2204", "nvidia")
    host.add_other("0000:03:00.1", "0x040300", "0x1002", "0xab30", "snd_hda_intel")
    host.set_ppfeaturemask("0xfff7bfff")
    return host


def test_discovery_picks_amdgpu_display_devices_by_pci_address(incident_host):
    root = SysfsRoot(incident_host.root)
    devs = discover(root)
    assert [d.bdf for d in devs] == ["0000:03:00.0", "0000:08:00.0", "0000:0b:00.0"]
    xtx, r9070, n6600 = devs
    assert (xtx.vendor, xtx.device_id, xtx.subsystem, xtx.revision) == ("1002", "744c", "1da2:e471", "c8")
    assert xtx.model == "Radeon RX 7900 XTX"
    assert xtx.pci_class == "0x030000"
    assert (xtx.card, r9070.card) == ("card0", "card1")
    assert xtx.hwmon_path == f"{xtx.sysfs_path}/hwmon/hwmon5"
    assert r9070.hwmon_path.endswith("/0000:08:00.0/hwmon/hwmon2")
    assert xtx.sysfs_path.startswith("/sys/devices/pci0000:00/") and xtx.sysfs_path.endswith("/0000:03:00.0")
    assert r9070.model == "Radeon RX 9070 / 9070 XT"
    assert n6600.od_path is None and xtx.od_path.endswith("/pp_od_clk_voltage")


def test_model_names_known_and_unknown(host):
    dev = host.add_gpu(XTX, "0000:03:00.0")
    (dev / "device").write_text("0x7551\n")
    dev2 = host.add_gpu(R9070, "0000:08:00.0")
    (dev2 / "device").write_text("0x7999\n")
    models = [d.model for d in discover(SysfsRoot(host.root))]
    assert models == ["Radeon AI PRO R9700", "AMD GPU 1002:7999"]


def test_read_gpu_values_7900xtx(incident_host):
    root = SysfsRoot(incident_host.root)
    xtx = discover(root)[0]
    s = read_gpu(root, xtx, "xtx0")
    assert s.up and s.errors == {}
    assert (s.name, s.bdf, s.vendor, s.device_id, s.driver, s.card) == ("xtx0", "0000:03:00.0", "1002", "744c", "amdgpu", "card0")
    assert s.runtime_status == "active"
    assert (s.power_watts, s.power_cap_watts, s.power_cap_min_watts, s.power_cap_max_watts, s.power_cap_default_watts) == (68.0, 290.0, 261.0, 333.0, 290.0)
    assert dict(s.temperatures) == {"edge": 53.0, "junction": 61.0, "mem": 68.0}
    assert dict(s.temperature_limits) == {
        ("edge", "crit"): 100.0, ("edge", "emergency"): 105.0,
        ("junction", "crit"): 110.0, ("junction", "emergency"): 115.0,
        ("mem", "crit"): 108.0, ("mem", "emergency"): 113.0,
    }
    assert dict(s.clocks_hz) == {"sclk": 31e6, "mclk": 1249e6}
    assert dict(s.voltages) == {"vddgfx": 0.686}
    assert (s.fan_rpm, s.busy_ratio, s.performance_level) == (0.0, 0.03, "auto")
    # This dump has no mem_info_* files: absent hardware data is None without an error.
    assert s.vram_total_bytes is None and "vram_total_bytes" not in s.errors
    assert s.od.format == "rdna3"
    assert dict(s.od.settings) == {"sclk_min_mhz": 500, "sclk_max_mhz": 2735, "mclk_min_mhz": 97, "mclk_max_mhz": 1250, "vddgfx_offset_mv": 0}
    assert (s.od.ranges["sclk_max_mhz"].min, s.od.ranges["sclk_max_mhz"].max) == (500, 5000)
    assert (s.od.ranges["vddgfx_offset_mv"].min, s.od.ranges["vddgfx_offset_mv"].max) == (-450, 0)
    assert s.od_error is None


def test_read_gpu_rdna4_and_vram(host):
    dev = host.add_gpu(R9070, "0000:08:00.0")
    for name, value in (("mem_info_vram_total", 17095983104), ("mem_info_vram_used", 1048576), ("mem_info_vis_vram_total", 17095983104)):
        (dev / name).write_text(f"{value}\n")
    root = SysfsRoot(host.root)
    s = read_gpu(root, discover(root)[0], "r0")
    assert s.errors == {}
    assert (s.vram_total_bytes, s.vram_used_bytes, s.vram_visible_bytes) == (17095983104, 1048576, 17095983104)
    assert (s.power_watts, s.power_cap_watts, s.power_cap_min_watts) == (49.0, 200.0, 0.0)
    assert s.od.format == "rdna4" and s.od.settings["sclk_offset_mhz"] == 0
    assert s.od.ranges["sclk_offset_mhz"].min == -500
    assert s.fan_rpm == 1944.0 and s.busy_ratio == 0.25


def _swap_temp_numbers(hw):
    """temp1_* <-> temp2_* : labels now sit on other numbers, as after a driver change."""
    for f in list(hw.iterdir()):
        if f.name.startswith(("temp1_", "temp2_")):
            f.rename(hw / ("x" + f.name))
    for f in list(hw.iterdir()):
        if f.name.startswith("xtemp1_"):
            f.rename(hw / f.name.replace("xtemp1_", "temp2_"))
        elif f.name.startswith("xtemp2_"):
            f.rename(hw / f.name.replace("xtemp2_", "temp1_"))


def _values(s):
    d = s.to_dict()
    del d["time"]
    return d


def test_same_readings_whatever_the_hwmon_index_or_sensor_number(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3, card=1)
    root = SysfsRoot(host.root)
    first = read_gpu(root, discover(root)[0], "g")
    # "Next boot": hwmon3 becomes hwmon7, temp1/temp2 swap, card1 becomes card0.
    (a / "hwmon/hwmon3").rename(a / "hwmon/hwmon7")
    _swap_temp_numbers(a / "hwmon/hwmon7")
    (a / "drm/card1").rename(a / "drm/card0")
    dev = discover(root)[0]
    assert dev.hwmon_path.endswith("/hwmon/hwmon7") and dev.card == "card0"
    second = read_gpu(root, dev, "g")
    assert second.temperatures["edge"] == 53.0 and second.temperatures["junction"] == 61.0
    v1, v2 = _values(first), _values(second)
    assert v1.pop("card") == "card1" and v2.pop("card") == "card0"
    assert v1 == v2


def test_hwmon_renumbered_while_running_is_flagged_for_rediscovery(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3)
    root = SysfsRoot(host.root)
    dev = discover(root)[0]
    (a / "hwmon/hwmon3").rename(a / "hwmon/hwmon4")
    s = read_gpu(root, dev, "g")
    assert s.up, "the device is still there: not lost"
    assert s.extra.get("rediscover") is True
    assert s.power_watts is None and "hwmon3/power1_average: ENOENT" in s.errors["power_watts"]
    assert s.busy_ratio == 0.03 and s.od is not None  # device files still read
    again = read_gpu(root, discover_one(root, dev.bdf), "g")
    assert again.errors == {} and again.power_watts == 68.0 and not again.extra


def test_garbage_in_one_file_drops_only_that_value(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3)
    (a / "hwmon/hwmon3/temp2_input").write_bytes(b"\xff\xfegarbage\n")
    root = SysfsRoot(host.root)
    s = read_gpu(root, discover(root)[0], "g")
    assert s.up
    assert "junction" not in s.temperatures
    err = s.errors["temperature_junction"]
    assert "/hwmon/hwmon3/temp2_input" in err and "expected an integer" in err
    assert dict(s.temperatures) == {"edge": 53.0, "mem": 68.0}
    assert s.power_watts == 68.0 and s.od.format == "rdna3"
    assert list(s.errors) == ["temperature_junction"]


def test_a_100_kb_number_drops_only_that_value_with_the_file_named(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3)
    (a / "hwmon/hwmon3/freq1_input").write_bytes(b"7" * 100_000 + b"\n")
    root = SysfsRoot(host.root)
    s = read_gpu(root, discover(root)[0], "g")
    assert s.up and "sclk" not in s.clocks_hz
    err = s.errors["clock_sclk"]
    # Python's own "Exceeds the limit (4300 digits)" named no file
    assert "/hwmon/hwmon3/freq1_input" in err and " digits: longer than" in err, err
    assert list(s.errors) == ["clock_sclk"] and s.power_watts == 68.0


def test_read_error_is_an_error_not_a_zero(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3)
    root = SysfsRoot(host.root)
    dev = discover(root)[0]
    p = a / "hwmon/hwmon3/power1_average"
    p.unlink()
    p.mkdir()  # reading a directory: a real EISDIR from the kernel
    s = read_gpu(root, dev, "g")
    assert s.up and s.power_watts is None
    assert "power1_average: EISDIR" in s.errors["power_watts"]
    assert not s.extra  # not a vanished file: no rediscovery


def test_device_vanishing_mid_read_is_lost_without_traceback(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3)
    dev = discover(SysfsRoot(host.root))[0]

    def unplug(n, rel):
        if n == 6:  # after a few values were read, the card falls off the bus
            shutil.rmtree(a)
            os.unlink(host.sys / "bus/pci/devices/0000:03:00.0")

    root = RecordingRoot(host.root, unplug)
    s = read_gpu(root, dev, "g")
    assert s.up is False
    assert "GPU 0000:03:00.0 is gone" in s.errors["device"] and "ENOENT" in s.errors["device"]
    assert len(root.reads) == 7  # it stopped at the first failed read
    assert s.od is None and s.power_watts is None


def test_device_gone_before_poll(incident_host):
    root = SysfsRoot(incident_host.root)
    devs = discover(root)
    shutil.rmtree(incident_host.device_dir("0000:08:00.0"))
    gone = read_gpu(root, devs[1], "r0")
    assert not gone.up and "gone" in gone.errors["device"]
    assert read_gpu(root, devs[0], "x0").up  # the other GPU is unaffected


def test_runtime_suspended_gpu_is_not_woken(host):
    a = host.add_gpu(XTX, "0000:03:00.0", runtime_status="suspended")
    dev = discover(SysfsRoot(host.root))[0]
    root = RecordingRoot(host.root)
    s = read_gpu(root, dev, "g")
    assert s.up and s.runtime_status == "suspended"
    assert root.reads == [f"{dev.sysfs_path}/power/runtime_status"]
    assert s.power_watts is None and s.od is None and s.errors == {}
    (a / "power/runtime_status").write_text("active\n")
    assert read_gpu(root, dev, "g").power_watts == 68.0


@pytest.mark.parametrize(
    "mask, words",
    [
        ("0xfff7bfff", "amdgpu.ppfeaturemask=0xfff7bfff lacks the overdrive bit 0x4000; add amdgpu.ppfeaturemask=0xfff7ffff"),
        ("4294426623", "amdgpu.ppfeaturemask=0xfff7bfff lacks"),  # decimal print of the same mask
        ("0xffffffff", "has the overdrive bit 0x4000: this card or its VBIOS does not support OD"),
        (None, "ppfeaturemask could not be read"),
    ],
)
def test_od_disabled_says_which_kernel_parameter(host, mask, words):
    host.add_gpu(N6600XT, "0000:0b:00.0")
    if mask is not None:
        host.set_ppfeaturemask(mask)
    root = SysfsRoot(host.root)
    s = read_gpu(root, discover(root)[0], "g")
    assert s.od is None and "od" not in s.errors  # a state, not a read error
    assert words in s.od_error
    if mask is None:
        assert "add amdgpu.ppfeaturemask=0xfff7ffff" in s.od_error


def test_od_parse_error_is_recorded_with_file_and_line(host):
    a = host.add_gpu(XTX, "0000:03:00.0")
    (a / "pp_od_clk_voltage").write_text("OD_SCLK:\n0: 500Mhz\n1: 2735Mhz\nOD_TURBO:\n1\n")
    root = SysfsRoot(host.root)
    s = read_gpu(root, discover(root)[0], "g")
    assert s.up and s.od is None
    assert s.od_error == s.errors["od"]
    assert "pp_od_clk_voltage: line 4: unknown section OD_TURBO" in s.od_error
    assert s.power_watts == 68.0


def test_clock_falls_back_to_the_marked_dpm_level(host):
    a = host.add_gpu(XTX, "0000:03:00.0", hwmon=3)
    for n in ("freq1_input", "freq1_label"):
        (a / "hwmon/hwmon3" / n).unlink()
    root = SysfsRoot(host.root)
    dev = discover(root)[0]
    assert f"{dev.sysfs_path}/pp_dpm_sclk" in dev.poll_paths()
    s = read_gpu(root, dev, "g")
    assert dict(s.clocks_hz) == {"sclk": 31e6, "mclk": 1249e6}  # '1: 31Mhz *'


def test_power_input_when_no_average_and_vangogh_slowppt(host):
    a = host.add_gpu("apu-phoenix-phoenix-15bf", "0000:64:00.0", hwmon=6)
    (a / "hwmon/hwmon6/power1_average").unlink()
    host.add_gpu("apu-vangogh-vangogh", "0000:04:00.0", hwmon=1)
    root = SysfsRoot(host.root)
    vg, phx = discover(root)
    p = read_gpu(root, phx, "phx")
    assert p.power_watts == 3.142 and p.model == "Radeon 780M (Phoenix)"
    assert dict(p.voltages) == {"vddgfx": 0.814, "vddnb": 0.615}
    assert p.od.format == "apu" and p.clocks_hz["sclk"] == 800e6
    v = read_gpu(root, vg, "deck")
    assert (v.power_watts, v.power_cap_watts, v.power_cap_max_watts) == (3.218, 15.0, 29.0)
    assert v.od.format == "empty" and v.od_error is None


def test_poll_paths_are_what_a_poll_reads(incident_host):
    dev = discover(SysfsRoot(incident_host.root))[0]
    root = RecordingRoot(incident_host.root)
    read_gpu(root, dev, "g")
    assert tuple(root.reads) == dev.poll_paths()
    assert dev.poll_paths()[0].endswith("/power/runtime_status")
    assert dev.poll_paths()[-1].endswith("/pp_od_clk_voltage")
    # runtime_status + busy + perf level + 3 temps x (input, crit, emergency) + power
    # average/cap/min/max/default + sclk + mclk + vddgfx + fan + OD (no mem_info_* here)
    assert len(dev.poll_paths()) == 1 + 2 + 9 + 5 + 2 + 1 + 1 + 1
    assert all(os.path.isfile(root.path(p)) for p in dev.poll_paths())


def test_hwmon_without_amdgpu_name_is_not_used(host):
    # The 7800 XT reference capture has no hwmon `name`: no folder is trusted as ours, and
    # the clocks come from the marked pp_dpm levels instead.
    host.add_gpu("rdna3-rx7800xt-amdref", "0000:2f:00.0", hwmon=2)
    root = SysfsRoot(host.root)
    dev = discover(root)[0]
    assert dev.hwmon_path is None
    s = read_gpu(root, dev, "g")
    assert s.power_watts is None and dict(s.temperatures) == {} and s.errors == {}
    assert dict(s.clocks_hz) == {"sclk": 0.0, "mclk": 96e6}
    assert s.od.settings["mclk_max_mhz"] == 1219


def test_devices_that_vanish_or_lie_during_discovery_are_skipped(incident_host):
    # A bus entry whose device is already gone (dangling link) and one with a garbage id.
    links = incident_host.sys / "bus/pci/devices"
    os.symlink("../../../devices/pci0000:00/0000:00:09.0/0000:0f:00.0", links / "0000:0f:00.0")
    (incident_host.device_dir("0000:08:00.0") / "vendor").write_text("AMD\n")
    root = SysfsRoot(incident_host.root)
    assert [d.bdf for d in discover(root)] == ["0000:03:00.0", "0000:0b:00.0"]
    assert discover_one(root, "0000:0f:00.0") is None
    assert discover_one(root, "0000:00:01.0") is None  # a bridge, not a GPU


def test_constants_are_read_at_discovery_then_once_a_minute_and_live_values_every_poll(incident_host, monkeypatch):
    """Issue 15: the temperature limits, the cap's bounds and default and the VRAM size are
    the firmware's numbers; a poll reads them once a minute, not every second — and serves
    the same values meanwhile."""
    from gpuguard.hw import amdgpu

    clock = [1000.0]
    monkeypatch.setattr(amdgpu.time, "monotonic", lambda: clock[0])
    root = RecordingRoot(incident_host.root)
    xtx = discover(root)[0]
    constants = {p.path for p in xtx.probes if p.constant}
    assert {os.path.basename(p) for p in constants} == {
        "temp1_crit", "temp1_emergency", "temp2_crit", "temp2_emergency", "temp3_crit", "temp3_emergency",
        "power1_cap_min", "power1_cap_max", "power1_cap_default"}
    first = read_gpu(root, xtx, "xtx0")
    root.reads.clear()
    clock[0] += 59.0
    second = read_gpu(root, xtx, "xtx0")
    assert not constants & set(root.reads)
    assert {os.path.basename(r) for r in root.reads} >= {"power1_average", "power1_cap", "temp1_input", "freq1_input"}
    assert (second.temperature_limits, second.power_cap_min_watts, second.power_cap_max_watts,
            second.power_cap_default_watts) == (first.temperature_limits, 261.0, 333.0, 290.0)
    root.reads.clear()
    clock[0] += 1.5
    read_gpu(root, xtx, "xtx0")
    assert constants <= set(root.reads)


def test_a_constant_that_fails_is_an_error_that_poll_and_is_read_again(incident_host, monkeypatch):
    root = RecordingRoot(incident_host.root)
    xtx = discover(root)[0]
    read_gpu(root, xtx, "xtx0")
    (cap_max,) = [p.path for p in xtx.probes if p.path.endswith("power1_cap_max")]
    from gpuguard.hw import amdgpu

    monkeypatch.setattr(amdgpu, "CONSTANT_EVERY_S", 0.0)
    disk = os.path.join(incident_host.root, cap_max.lstrip("/"))
    with open(disk, "w") as f:
        f.write("garbage\n")
    s = read_gpu(root, xtx, "xtx0")
    assert s.power_cap_max_watts is None and "power1_cap_max" in s.errors["power_cap_max_watts"]
    monkeypatch.setattr(amdgpu, "CONSTANT_EVERY_S", 60.0)
    with open(disk, "w") as f:
        f.write("333000000\n")
    assert read_gpu(root, xtx, "xtx0").power_cap_max_watts == 333.0   # not served from a cache of the failure
