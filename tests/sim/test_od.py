"""amdgpu OD / power-cap / performance-level write semantics per generation, as the
kernel implements them (reference/amdgpu-od-protocol.md)."""
from __future__ import annotations

import errno

import pytest

from gpuguard.sim import cards
from gpuguard.sim.host import SimHost

R9700 = "0000:05:00.0"
XTX = "0000:aa:00.0"


def od(h: SimHost, bdf: str) -> str:
    return f"{h.device_path(bdf)}/pp_od_clk_voltage"


def cap(h: SimHost, bdf: str) -> str:
    return f"{h.hwmon_path(bdf)}/power1_cap"


def write_err(h, path, data) -> int:
    with pytest.raises(OSError) as ei:
        h.write(path, data)
    return ei.value.errno


def last_log(h: SimHost) -> str:
    return h.kernel_log.records[-1].text


def text(h, path) -> str:
    return h.read(path).replace(b"\0", b"").decode()


def test_rdna4_stage_then_commit(incident):
    h = incident
    g = h.gpu(R9700)
    assert h.write(od(h, R9700), b"s -500\n") == 7
    assert h.write(od(h, R9700), b"vo -100\n") == 8
    # The read-back echoes the staging table before `c`: it proves nothing yet (INCIDENTS §3).
    assert "OD_SCLK_OFFSET:\n-500Mhz\n" in text(h, od(h, R9700))
    assert "OD_VDDGFX_OFFSET:\n-100mV\n" in text(h, od(h, R9700))
    assert g.od.active["sclk_offset"] == 0 and g.od.active["vddgfx_offset"] == 0
    h.write(od(h, R9700), b"c\n")
    assert g.od.active["sclk_offset"] == -500 and g.od.active["vddgfx_offset"] == -100


@pytest.mark.parametrize("data, log", [
    (b"vo 50\n", "amdgpu 0000:05:00.0: Voltage offset (50) must be within [-200, 0]!"),
    (b"s -600\n", "amdgpu 0000:05:00.0: GfxclkFoffset must be within [-500, 1000]!"),
    (b"s 1 -300\n", "amdgpu 0000:05:00.0: invalid number of input parameters 2"),
    (b"m 1 1600\n", "amdgpu 0000:05:00.0: UclkFmax (1600) must be within [97, 1500]!"),
])
def test_rdna4_refusals_are_einval_with_reason_in_kernel_log(incident, data, log):
    h = incident
    before = h.read(od(h, R9700))
    assert write_err(h, od(h, R9700), data) == errno.EINVAL
    assert last_log(h) == log
    assert h.read(od(h, R9700)) == before


@pytest.mark.parametrize("data", [b"", b"x 1\n", b"s abc\n", b"s -500 foo\n", b"q\n", b"s " + b"1 " * 70])
def test_malformed_writes_are_einval_without_log(incident, data):
    h = incident
    n = len(h.kernel_log)
    assert write_err(h, od(h, R9700), data) == errno.EINVAL
    assert len(h.kernel_log) == n


def test_kstrtol_bases_like_the_kernel(incident):
    h = incident
    h.write(od(h, R9700), b"s -0x1f4\n")          # hex, as kstrtol(…, 0) accepts
    assert "-500Mhz" in text(h, od(h, R9700))
    h.write(od(h, R9700), b"s 010\n")              # leading 0 = octal 8
    assert "OD_SCLK_OFFSET:\n8Mhz" in text(h, od(h, R9700))


def test_restore_resets_and_commits_on_smu13_and_smu14(incident):
    h = incident
    for bdf, cmd in ((R9700, b"s -500\n"), (XTX, b"s 1 1500\n")):
        h.write(od(h, bdf), cmd)
        h.write(od(h, bdf), b"c\n")
        g = h.gpu(bdf)
        assert g.od.active != g.od.boot
        h.write(od(h, bdf), b"r\n")                 # r falls through to commit
        assert g.od.active == g.od.boot and g.od.staged == g.od.boot


def test_smu13_pairs_range_and_min_max(incident):
    h = incident
    g = h.gpu(XTX)
    h.write(od(h, XTX), b"s 0 600 1 2000\n")
    assert "OD_SCLK:\n0: 600Mhz\n1: 2000Mhz\n" in text(h, od(h, XTX))
    assert write_err(h, od(h, XTX), b"s 1 400\n") == errno.EINVAL
    assert last_log(h) == "amdgpu 0000:aa:00.0: GfxclkFmax (400) must be within [500, 5000]!"
    # min > max is checked after the whole line; the kernel has already staged the values.
    assert write_err(h, od(h, XTX), b"s 0 2100 1 1800\n") == errno.EINVAL
    assert last_log(h) == "amdgpu 0000:aa:00.0: Invalid setting: GfxclkFmin(2100) is bigger than GfxclkFmax(1800)"
    assert g.od.staged["sclk_min"] == 2100 and g.od.staged["sclk_max"] == 1800
    assert write_err(h, od(h, XTX), b"s 2 1000\n") == errno.EINVAL
    assert "Invalid SCLK_VDDC_TABLE index: 2" in [r.text.split(": ", 1)[1] for r in h.kernel_log.records[-2:]]
    assert write_err(h, od(h, XTX), b"vo -500\n") == errno.EINVAL
    assert last_log(h) == "amdgpu 0000:aa:00.0: Voltage offset (-500) must be within [-450, 0]!"


def test_smu13_cap_written_before_commit_is_not_enforced(incident):
    """LACT #430/#506: on RDNA3 the cap written after the OD commit is what the card enforces."""
    h = incident
    g = h.gpu(XTX)
    h.write(cap(h, XTX), b"330000000\n")
    h.write(od(h, XTX), b"s 1 2000\n")
    h.write(od(h, XTX), b"c\n")
    assert h.read(cap(h, XTX)) == b"330000000\n"
    assert g.enforced_cap_w == 355
    h.write(cap(h, XTX), b"330000000\n")
    assert g.enforced_cap_w == 330


def test_navi2x_order_matters_and_vo_unchecked(single_gpu_host):
    h = single_gpu_host(cards.RX6800, 0x03)
    bdf = h.gpus[0]
    p = od(h, bdf)
    assert write_err(h, p, b"s 0 2400\n") == errno.EINVAL
    assert last_log(h) == f"amdgpu {bdf}: GfxclkFmin (2400) must be <= GfxclkFmax (2314)!"
    h.write(p, b"s 1 2500\n")
    h.write(p, b"s 0 2400\n")
    h.write(p, b"vo 50\n")                          # Navi2x does not range-check vo
    assert "OD_VDDGFX_OFFSET:\n50mV" in text(h, p)
    assert write_err(h, p, b"m 0 97\n") == errno.EINVAL   # printed value below OD_RANGE is refused
    assert "out of range [674, 1075]" in last_log(h)


def test_linux66_smu13_vddc_curve(single_gpu_host):
    h = single_gpu_host(cards.XTX, 0x03, era="6.6")
    p = od(h, h.gpus[0])
    assert write_err(h, p, b"vo -100\n") == errno.EINVAL
    h.write(p, b"vc 2 -50\n")
    assert "OD_VDDC_CURVE:\n0: 0mv\n1: 0mv\n2: -50mv\n" in text(h, p)
    assert write_err(h, p, b"vc 6 -50\n") == errno.EINVAL


@pytest.mark.parametrize("data, err", [
    (b"209000000\n", errno.EINVAL), (b"301000000", errno.EINVAL), (b"abc", errno.EINVAL),
    (b"-5", errno.EINVAL), (b"5000000000", errno.ERANGE), (b"0", errno.EINVAL), (b"0x10", errno.EINVAL)])
def test_power_cap_refusals(incident, data, err):
    h = incident
    assert write_err(h, cap(h, R9700), data) == err
    assert h.read(cap(h, R9700)) == b"300000000\n"


def test_power_cap_in_range_truncates_to_watts_and_logs_out_of_range(incident):
    h = incident
    h.write(cap(h, R9700), b"250999999\n")
    assert h.read(cap(h, R9700)) == b"250000000\n"
    write_err(h, cap(h, R9700), b"209000000\n")
    assert last_log(h) == "amdgpu 0000:05:00.0: New power limit (209) is out of range [210,300]"


def test_performance_level_words_per_era(incident, single_gpu_host):
    h = incident
    p = f"{h.device_path(R9700)}/power_dpm_force_performance_level"
    h.write(p, b"manual\n")
    assert h.read(p) == b"manual\n"
    assert write_err(h, p, b"turbo\n") == errno.EINVAL
    h.write(p, b"lowest\n")                          # 6.14: strncmp prefix match
    assert h.read(p) == b"low\n"
    h70 = single_gpu_host(cards.R9700, 0x03, era="7.0")
    p70 = f"{h70.device_path(h70.gpus[0])}/power_dpm_force_performance_level"
    assert write_err(h70, p70, b"lowest\n") == errno.EINVAL   # 7.0: sysfs_streq
    h70.write(p70, b"high\n")
    assert h70.read(p70) == b"high\n"


def test_pp_dpm_writes_need_manual_and_change_nothing(incident):
    h = incident
    dev = h.device_path(R9700)
    assert write_err(h, f"{dev}/pp_dpm_sclk", b"s 2 1500\n") == errno.EINVAL   # INCIDENTS §2
    assert write_err(h, f"{dev}/pp_dpm_sclk", b"1\n") == errno.EINVAL          # not manual
    h.write(f"{dev}/power_dpm_force_performance_level", b"manual")
    h.set_load(R9700, 1.0)
    h.step(1.0)
    before = h.gpu(R9700).sensors.sclk_mhz
    assert h.write(f"{dev}/pp_dpm_sclk", b"0\n") == 2
    h.step(1.0)
    assert h.gpu(R9700).sensors.sclk_mhz == before     # accepted, silently ignored
    assert write_err(h, f"{dev}/pp_dpm_mclk", b"9\n") == errno.EINVAL          # no level 9


def test_gpu_reset_restores_stock_silently_and_is_busy_while_running(incident):
    h = incident
    g = h.gpu(R9700)
    h.write(od(h, R9700), b"s -500\n")
    h.write(od(h, R9700), b"c\n")
    h.write(cap(h, R9700), b"210000000\n")
    h.reset_gpu(R9700, steps=1)
    with pytest.raises(OSError) as ei:
        h.read(od(h, R9700))
    assert ei.value.errno == errno.EPERM                 # 6.14 access gate while in reset
    h.step(0.5)
    assert "OD_SCLK_OFFSET:\n0Mhz" in text(h, od(h, R9700))
    assert h.read(cap(h, R9700)) == b"300000000\n"
    assert g.od.active["sclk_offset"] == 0
    msgs = [r.text for r in h.kernel_log.records[-2:]]
    assert msgs == ["amdgpu 0000:05:00.0: amdgpu: GPU reset begin!", "amdgpu 0000:05:00.0: GPU reset(1) succeeded!"]


@pytest.mark.parametrize("era, err", [("6.14", errno.EPERM), ("7.0", errno.EBUSY), ("6.12", None)])
def test_runtime_suspended_reads_per_era(single_gpu_host, era, err):
    h = single_gpu_host(cards.R9700, 0x03, era=era)
    bdf = h.gpus[0]
    dev = h.device_path(bdf)
    assert h.suspend(bdf)
    assert h.read(f"{dev}/power/runtime_status") == b"suspended\n"
    assert h.read(f"{dev}/mem_info_vram_total")       # not a PM attribute: no gate
    if err is None:
        assert h.read(f"{dev}/gpu_busy_percent") == b"0\n"     # 6.12: the read wakes it
        assert h.read(f"{dev}/power/runtime_status") == b"active\n"
    else:
        with pytest.raises(OSError) as ei:
            h.read(f"{dev}/gpu_busy_percent")
        assert ei.value.errno == err
        h.write(od(h, bdf), b"s -100\n")                 # writes wake it
        assert h.read(f"{dev}/power/runtime_status") == b"active\n"


def test_suspended_card_whose_resume_fails_refuses_writes(incident):
    h = incident
    h.suspend(R9700, resume_error=errno.EIO)              # LACT #1057, headless R9700 at boot
    assert write_err(h, od(h, R9700), b"s -500\n") == errno.EIO
    h.write(f"{h.device_path(R9700)}/power/control", b"on\n")
    h.write(od(h, R9700), b"s -500\n")
    assert not h.suspend(R9700)                           # control=on keeps it awake


@pytest.mark.parametrize("kind, data", [("commit", b"c\n"), ("stage", b"s -500\n")])
def test_card_ignores_first_write(incident, kind, data):
    h = incident
    g = h.gpu(R9700)
    h.ignore_first_write(R9700, kind)
    for _ in range(2):
        h.write(od(h, R9700), b"s -500\n")
        h.write(od(h, R9700), b"c\n")
        if _ == 0:
            assert g.od.active["sclk_offset"] == 0       # silently not applied ...
            assert "OD_SCLK_OFFSET:\n0Mhz" in text(h, od(h, R9700))   # ... and the read-back shows it
    assert g.od.active["sclk_offset"] == -500           # the retry works


def test_ignore_first_power_cap_write(incident):
    h = incident
    h.ignore_first_write(R9700, "power_cap")
    h.write(cap(h, R9700), b"210000000\n")
    assert h.read(cap(h, R9700)) == b"300000000\n"
    h.write(cap(h, R9700), b"210000000\n")
    assert h.read(cap(h, R9700)) == b"210000000\n"


def test_od_disabled_by_ppfeaturemask():
    h = SimHost.incident(od_enabled=False)
    assert h.read("/sys/module/amdgpu/parameters/ppfeaturemask") == b"0xfff7bfff\n"
    for bdf in h.gpus:
        assert not h.exists(od(h, bdf))
    assert h.read(f"{h.hwmon_path(XTX)}/power1_cap_max") == b"355000000\n"   # no OD headroom
    assert SimHost.incident().read("/sys/module/amdgpu/parameters/ppfeaturemask") == b"0xfff7ffff\n"
