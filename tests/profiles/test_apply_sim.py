"""Apply against the simulated incident host through a real FUSE mount."""

from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.profiles.apply import Applier, CardTarget
from gpuguard.profiles.kernel_reason import KmsgReasons
from gpuguard.profiles.schema import Profile
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse]  # registered in pyproject.toml


R9700 = Profile(power_cap_w=210, sclk_offset_mhz=-500, vddgfx_offset_mv=-100)
XTX = Profile(sclk_max_mhz=2000, vddgfx_offset_mv=-100)


def applier(m, audit=None, **kw):
    root = SysfsRoot(m.mountpoint)
    return Applier(root, audit=audit, kernel_reason=KmsgReasons(root), sleep=lambda s: None, **kw)


def test_incident_profile_writes_in_lacts_order_and_reads_back(mount_sim):
    m = mount_sim()
    log = []
    a = applier(m, audit=log.append)
    r = a.apply(CardTarget("r9700-a", "0000:05:00.0"), "psu-safe", R9700, "test", "incident §2")
    assert r.verified, r.message
    assert r.readback["sclk_offset_mhz"] == -500 and r.readback["vddgfx_offset_mv"] == -100
    assert r.readback["power_cap_w"] == 210 and r.before["power_cap_w"] == 300
    assert m.writes() == [
        "control: on",
        "pp_od_clk_voltage: s -500",
        "pp_od_clk_voltage: vo -100",
        "pp_od_clk_voltage: c",
        "power1_cap: 210000000",
        "control: auto",
    ]
    assert m.host.gpu("0000:05:00.0").od.active["sclk_offset"] == -500  # committed, not just staged
    files = [rec["file"].rsplit("/", 1)[-1] for rec in log if rec["action"] == "write"]
    assert files == ["control", "pp_od_clk_voltage", "pp_od_clk_voltage", "pp_od_clk_voltage", "power1_cap", "control"]
    assert all(rec["who"] == "test" and rec["why"] for rec in log)


def test_xtx_uses_rdna3_syntax_chosen_from_the_file(mount_sim):
    m = mount_sim()
    r = applier(m).apply(CardTarget("xtx-a", "0000:aa:00.0"), "fast", XTX, "test", "incident §3")
    assert r.verified, r.message
    assert [w for w in m.writes() if w.startswith("pp_od")] == [
        "pp_od_clk_voltage: s 1 2000", "pp_od_clk_voltage: vo -100", "pp_od_clk_voltage: c"]


def test_card_ignoring_first_write_is_retried_and_verified(mount_sim):
    m = mount_sim()
    m.host.gpu("0000:08:00.0").faults.ignore_next.add("stage")
    r = applier(m).apply(CardTarget("r9700-b", "0000:08:00.0"), "psu-safe", R9700, "test", "retry")
    assert r.verified and r.attempts == 2, r
    assert "read back differs" in r.errors[0]


def test_power_cap_ignored_once_is_retried(mount_sim):
    m = mount_sim()
    m.host.gpu("0000:05:00.0").faults.ignore_next.add("power_cap")
    r = applier(m).apply(CardTarget("r9700-a", "0000:05:00.0"), "psu-safe", R9700, "test", "retry")
    assert r.verified and r.attempts == 2
    assert "power_cap_w wrote 210 read 300" in r.errors[0]


def test_out_of_range_refused_before_any_write(mount_sim):
    m = mount_sim()
    bad = Profile(power_cap_w=210, sclk_offset_mhz=-600, vddgfx_offset_mv=-100)
    a = applier(m)
    results = [a.apply(CardTarget(f"g{i}", b), "bad", bad, "test", "refusal") for i, b in enumerate(("0000:05:00.0", "0000:08:00.0"))]
    assert all(r.result == "refused" and not r.verified for r in results)
    assert "sclk_offset_mhz=-600 MHz refused: outside the card's OD_RANGE -500…1000 MHz" in results[0].message
    assert results[0].message.startswith("g0:")
    assert m.recorder.writes == []  # nothing written to any card, not even power/control


def test_persistent_mismatch_marks_unverified_after_retries(mount_sim):
    m = mount_sim()
    g = m.host.gpu("0000:05:00.0")
    a = applier(m, retries=2)
    # every staging write is swallowed: the card never shows the offset
    orig = g.write_od

    def swallow(data):
        if data.startswith(b"s"):
            return
        orig(data)

    for fd in m.host.nodes.values():
        if fd.filedef is not None and fd.name == "pp_od_clk_voltage" and fd.gpu is g:
            fd.filedef.write = swallow
    r = a.apply(CardTarget("r9700-a", "0000:05:00.0"), "psu-safe", R9700, "test", "mismatch")
    assert not r.verified and r.result == "mismatch" and r.attempts == 3
    assert "sclk_offset_mhz wrote -500 read 0" in r.message


def test_einval_reports_file_errno_and_kernel_reason(mount_sim):
    m = mount_sim()
    a = applier(m)
    # A profile that passes our range check but the card refuses: the kernel's own
    # checks are what count (bypass validation by widening the parsed range).
    target = CardTarget("r9700-a", "0000:05:00.0")
    reading = a.read(target)
    from gpuguard.profiles.plan import Plan, Write

    plan = Plan("r9700-a", "x", reading.od.format, (Write("pp_od_clk_voltage", "vo -300", "vddgfx_offset_mv"),
                                                     Write("pp_od_clk_voltage", "c")), {"vddgfx_offset_mv": -300})
    r = a._execute(target, plan, reading.values(), "test", "einval")
    assert r.result == "error" and not r.verified
    assert "pp_od_clk_voltage: EINVAL (Invalid argument)" in r.message
    assert "kernel log:" in r.message and "-300" in r.message.split("kernel log:")[1]
    assert r.attempts == 1  # EINVAL is not retried: the same bytes would be refused again


def test_runtime_suspended_card_is_woken_and_restored(mount_sim):
    m = mount_sim()
    assert m.host.suspend("0000:b0:00.0")
    r = applier(m).apply(CardTarget("xtx-b", "0000:b0:00.0"), "fast", XTX, "test", "asleep")
    assert r.verified, r.message
    g = m.host.gpu("0000:b0:00.0")
    assert g.runtime_control == "auto"
    assert m.writes()[0] == "control: on" and m.writes()[-1] == "control: auto"


def test_lost_gpu_is_never_written(mount_sim):
    m = mount_sim()
    a = applier(m, is_lost=lambda bdf: bdf == "0000:aa:00.0")
    r = a.apply(CardTarget("xtx-a", "0000:aa:00.0"), "fast", XTX, "test", "lost")
    assert r.result == "lost" and m.recorder.writes == []


def test_reset_writes_r_and_default_cap_and_verifies_stock(mount_sim):
    m = mount_sim()
    a = applier(m)
    t = CardTarget("r9700-a", "0000:05:00.0")
    assert a.apply(t, "psu-safe", R9700, "test", "setup").verified
    n = len(m.writes())
    r = a.reset(t, "test", "reset")
    assert r.verified, r.message
    assert m.writes()[n:] == ["control: on", "pp_od_clk_voltage: r", "power1_cap: 300000000", "control: auto"]
    assert r.readback["sclk_offset_mhz"] == 0 and r.readback["power_cap_w"] == 300


def test_setting_that_cannot_be_read_back_is_never_verified(mount_sim):
    """An R9700 on a kernel before the RDNA4 OD fix (d9d4cb224e41) prints the firmware
    limits where the offset should be: the write lands, but "applied" means read back
    equal, so the card is unverified with the exact reason."""
    from gpuguard.sim.host import SimHost

    m = mount_sim(SimHost.incident(era="6.12"))
    log = []
    r = applier(m, audit=log.append).apply(CardTarget("r9700-a", "0000:05:00.0"), "psu-safe",
                                            Profile(sclk_offset_mhz=-500), "test", "old kernel")
    assert r.result == "mismatch" and not r.verified
    assert r.message == ("sclk_offset_mhz cannot be read back on this kernel (SMU14 before d9d4cb224e41 prints "
                         "the firmware limits instead of the setting): unverified")
    assert [w for w in m.writes() if w.startswith("pp_od")] == ["pp_od_clk_voltage: s 1 -500",
                                                                 "pp_od_clk_voltage: c"]
    assert [rec["action"] for rec in log if rec["action"] in ("verified", "unverified")] == ["unverified"]


def test_gpu_lost_between_retries_stops_writing_at_once(mount_sim):
    """The first attempt reads back wrong; the GPU is marked lost during the backoff: the
    result is lost and not one write follows the first attempt's."""
    m = mount_sim()
    m.host.gpu("0000:05:00.0").faults.ignore_next.add("stage")
    lost = set()
    root = SysfsRoot(m.mountpoint)
    a = Applier(root, kernel_reason=KmsgReasons(root), sleep=lambda s: lost.add("0000:05:00.0"),
                is_lost=lambda bdf: bdf in lost)
    r = a.apply(CardTarget("r9700-a", "0000:05:00.0"), "psu-safe", R9700, "test", "lost mid-apply")
    assert r.result == "lost" and not r.verified and r.attempts == 2
    assert r.message == "GPU lost during apply; writing stopped"
    first = ["pp_od_clk_voltage: s -500", "pp_od_clk_voltage: vo -100", "pp_od_clk_voltage: c",
             "power1_cap: 210000000"]
    assert list(r.written) == first
    # not even the runtime-PM restore: a lost GPU is never written (DESIGN.md)
    assert m.writes() == ["control: on", *first]
