"""The apply sequence on the simulated host, in process (the simulator's file operations,
real errno, no FUSE mount): exact write lists, exact audit records, exact results and
reasons for every way an apply ends — verified, retried, unverified, lost before or
during, refused mid-apply, a card gone or in trouble, asleep, a dry run.
bench/mutation.sh found these unobserved; the FUSE tests (test_apply_sim.py) keep the
same sequence honest through real syscalls."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.profiles.apply import Applier, CardReading, CardResult, CardTarget, result_event
from gpuguard.profiles.kernel_reason import KmsgReasons
from gpuguard.profiles.plan import CapLimits, plan_apply
from gpuguard.profiles.schema import Profile
from gpuguard.sim.host import SimHost
from support import SimRoot

BDF = "0000:05:00.0"
DEV = f"/sys/bus/pci/devices/{BDF}"
OD = f"{DEV}/pp_od_clk_voltage"
CAP = f"{DEV}/hwmon/hwmon4/power1_cap"
CONTROL = f"{DEV}/power/control"
T = CardTarget("r9700-a", BDF)
PSU = Profile(power_cap_w=210, sclk_offset_mhz=-500, vddgfx_offset_mv=-100)
PLANNED = ("pp_od_clk_voltage: s -500", "pp_od_clk_voltage: vo -100", "pp_od_clk_voltage: c", "power1_cap: 210000000")
BEFORE = {"mclk_min_mhz": 97, "mclk_max_mhz": 1259, "vddgfx_offset_mv": 0, "sclk_offset_mhz": 0, "power_cap_w": 300,
          "performance_level": "auto"}
AFTER = {**BEFORE, "vddgfx_offset_mv": -100, "sclk_offset_mhz": -500, "power_cap_w": 210}
EXPECTED = {"sclk_offset_mhz": -500, "vddgfx_offset_mv": -100, "power_cap_w": 210}


class Recording(SimRoot):
    """Every write the applier makes, in order: (path, value, errno or 0)."""

    def __init__(self, host, files_root: str) -> None:
        super().__init__(host, files_root)
        self.writes: list[tuple[str, str, int]] = []

    def write_text(self, rel: str, value: str) -> None:
        try:
            super().write_text(rel, value)
        except Exception as e:
            self.writes.append((rel, value.rstrip("\n"), e.errno))
            raise
        self.writes.append((rel, value.rstrip("\n"), 0))

    def ok(self) -> list[tuple[str, str]]:
        return [(p, v) for p, v, err in self.writes if not err]


class Faulty(Recording):
    """Reads of the named files fail with the given errno (a card half asleep, a flaky
    hwmon), the rest goes to the simulator."""

    def __init__(self, host, files_root: str) -> None:
        super().__init__(host, files_root)
        self.fail: dict[str, int] = {}

    def read_bytes(self, rel: str) -> bytes:
        for suffix, err in self.fail.items():
            if rel.endswith(suffix):
                raise SysfsError(rel, err)
        return super().read_bytes(rel)


class Rig:
    def __init__(self, tmp_path: Path, host: SimHost | None = None, kmsg: bool = True, **kw) -> None:
        self.host = host or SimHost.incident()
        if kmsg:
            (tmp_path / "dev").mkdir()
            (tmp_path / "dev" / "kmsg").write_text("")
        self.root = Faulty(self.host, str(tmp_path))
        self.audit: list[dict] = []
        self.sleeps: list[float] = []
        self.on_sleep = lambda s: None
        self.reasons = KmsgReasons(self.root)
        kw.setdefault("sleep", self._sleep)
        self.applier = Applier(self.root, audit=self.audit.append, kernel_reason=self.reasons, **kw)

    def _sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.on_sleep(s)

    def gpu(self):
        return self.host.gpu(BDF)


@pytest.fixture
def rig(tmp_path):
    return lambda **kw: Rig(tmp_path, **kw)


def _write(file: str, value: str, why: str = "incident §2", **extra) -> dict:
    return {"action": "write", "who": "test", "why": why, "gpu": "r9700-a", "bdf": BDF, "file": file,
            "value": value, "result": "ok", **extra}


# ------------------------------------------------------------------ verified


def test_verified_apply_exactly(rig):
    r = rig()
    res = r.applier.apply(T, "psu-safe", PSU, "test", "incident §2")
    assert res == CardResult("r9700-a", BDF, "psu-safe", "ok", True, "read back equal after 1 attempt(s)",
                             before=BEFORE, planned=PLANNED, written=PLANNED, readback=AFTER, expected=EXPECTED,
                             attempts=1)
    assert r.root.ok() == [(CONTROL, "on"), (OD, "s -500"), (OD, "vo -100"), (OD, "c"), (CAP, "210000000"),
                           (CONTROL, "auto")]
    assert r.audit == [
        _write(CONTROL, "on", "keep the card awake while applying (incident §2)"),
        _write(OD, "s -500"), _write(OD, "vo -100"), _write(OD, "c"), _write(CAP, "210000000"),
        {"action": "verified", "who": "test", "why": "incident §2", "gpu": "r9700-a", "bdf": BDF,
         "profile": "psu-safe", "readback": AFTER, "attempts": 1},
        _write(CONTROL, "auto", "restore runtime power management"),
    ]
    assert r.sleeps == []
    ev = result_event(res)
    assert (ev.kind, ev.severity, ev.source, ev.gpu, ev.bdf, dict(ev.fields)) == (
        "profile_applied", "info", "profiles", "r9700-a", BDF, {"profile": "psu-safe"})
    assert ev.message == f"profile psu-safe on r9700-a ({BDF}) read back equal after 1 attempt(s)"
    assert res.to_dict() == {
        "gpu": "r9700-a", "bdf": BDF, "profile": "psu-safe", "result": "ok", "verified": True,
        "message": "read back equal after 1 attempt(s)", "before": BEFORE, "planned": list(PLANNED),
        "written": list(PLANNED), "readback": AFTER, "expected": EXPECTED, "attempts": 1, "errors": []}


def test_card_already_awake_is_not_woken_nor_restored(rig):
    r = rig()
    r.gpu().runtime_control = "on"
    assert r.applier.apply(T, "psu-safe", PSU, "test", "why").verified
    assert [p for p, _ in r.root.ok()].count(CONTROL) == 0


def test_reading_a_card(rig):
    r = rig()
    rd = r.applier.read(T)
    assert (rd.od.format, rd.od_missing, rd.od_error, rd.cap, rd.cap_error, rd.performance_level, rd.runtime_status,
            rd.transient) == ("rdna4", None, None, CapLimits(210_000_000, 300_000_000, 300_000_000, 300_000_000), None,
                              "auto", "active", False)
    assert rd.values() == BEFORE
    assert CardReading(None, None, None, None, None, None, None, False).values() == {}
    assert r.applier.hwmon(T) == f"{DEV}/hwmon/hwmon4"


def test_a_card_without_an_amdgpu_hwmon(rig):
    r = rig()
    r.host.garbage(BDF, "name", "nct6798\n")
    rd = r.applier.read(T)
    assert (rd.cap, rd.cap_error) == (None, f"{DEV}/hwmon: no amdgpu hwmon folder")
    res = r.applier.apply(T, "cap", Profile(power_cap_w=250), "test", "why")
    assert (res.result, res.message) == ("config", "r9700-a: profile setting power_cap_w: the card has no hwmon "
                                                   "power1_cap")


@pytest.mark.parametrize("fail,transient", [
    ({"/pp_od_clk_voltage": errno.EPERM}, True),
    ({"/pp_od_clk_voltage": errno.EIO}, False),
    ({"/power1_cap_max": errno.EBUSY}, True),
    ({"/power1_cap_max": errno.EIO}, False),
    ({"/power_dpm_force_performance_level": errno.EAGAIN}, True),
    ({"/power_dpm_force_performance_level": errno.EIO}, False),
    # one transient failure is enough, whatever fails after it
    ({"/pp_od_clk_voltage": errno.EPERM, "/power1_cap_max": errno.EIO}, True),
    ({"/power1_cap_min": errno.EPERM, "/power1_cap_max": errno.EIO}, True),
    ({"/pp_od_clk_voltage": errno.EBUSY, "/power_dpm_force_performance_level": errno.EIO}, True),
])
def test_a_read_failing_with_eperm_ebusy_or_eagain_means_asleep_or_resetting(rig, fail, transient):
    r = rig()
    r.root.fail = fail
    assert r.applier.read(T).transient is transient


def test_what_a_failed_read_leaves(rig):
    r = rig()
    r.root.fail = {"/pp_od_clk_voltage": errno.EIO, "/power1_cap_max": errno.EIO, "/runtime_status": errno.EIO,
                   "/power_dpm_force_performance_level": errno.EIO}
    rd = r.applier.read(T)
    assert (rd.od, rd.od_missing, rd.od_error) == (None, None, f"read {OD}: EIO (Input/output error)")
    assert rd.cap == CapLimits(210_000_000, None, 300_000_000, 300_000_000)
    assert rd.cap_error == f"read {DEV}/hwmon/hwmon4/power1_cap_max: EIO (Input/output error)"
    assert (rd.runtime_status, rd.performance_level) == (None, None)


def test_a_cap_limit_the_card_does_not_print_is_none_not_an_error(tmp_path):
    root = SysfsRoot(str(tmp_path))
    dev = tmp_path / DEV.lstrip("/")
    (dev / "hwmon" / "hwmon2").mkdir(parents=True)
    (dev / "hwmon" / "hwmon2" / "name").write_text("amdgpu\n")
    (dev / "hwmon" / "hwmon2" / "power1_cap").write_text("120000000\n")
    rd = Applier(root).read(T)
    assert (rd.cap, rd.cap_error) == (CapLimits(None, None, None, 120_000_000), None)


def test_the_amdgpu_hwmon_is_found_past_one_whose_name_cannot_be_read(tmp_path):
    dev = tmp_path / DEV.lstrip("/")
    (dev / "hwmon" / "hwmon1" / "name").mkdir(parents=True)  # reading a folder: EISDIR
    (dev / "hwmon" / "hwmon2").mkdir(parents=True)
    (dev / "hwmon" / "hwmon2" / "name").write_text("amdgpu\n")
    (dev / "hwmon" / "hwmon3").mkdir(parents=True)
    (dev / "hwmon" / "hwmon3" / "name").write_text("amdgpu\n")
    assert Applier(SysfsRoot(str(tmp_path))).hwmon(T) == f"{DEV}/hwmon/hwmon2"


def test_a_card_without_an_od_file_says_why(tmp_path):
    root = SysfsRoot(str(tmp_path))
    (tmp_path / DEV.lstrip("/")).mkdir(parents=True)
    params = tmp_path / "sys/module/amdgpu/parameters"
    params.mkdir(parents=True)
    (params / "ppfeaturemask").write_text("0xfff7bfff\n")
    rd = Applier(root).read(T)
    assert (rd.od, rd.od_error) == (None, None)
    assert rd.od_missing == ("OD is disabled at module load: amdgpu.ppfeaturemask=0xfff7bfff lacks the overdrive bit "
                             "0x4000; add amdgpu.ppfeaturemask=0xfff7ffff to the kernel command line and reboot (the "
                             "parameter cannot change at runtime)")


def test_an_od_table_that_does_not_parse_is_named_by_its_path(rig):
    r = rig()
    r.host.garbage(BDF, "pp_od_clk_voltage", "OD_SCLK:\n0: ???\n")
    rd = r.applier.read(T)
    assert rd.od is None and rd.od_error.startswith(f"{OD}: ")


def test_a_cap_limit_that_reads_as_an_empty_line(rig):
    r = rig()
    r.host.garbage(BDF, "power1_cap_min", "\n")
    rd = r.applier.read(T)
    assert rd.cap == CapLimits(None, 300_000_000, 300_000_000, 300_000_000)
    assert rd.cap_error == f"{DEV}/hwmon/hwmon4/power1_cap_min: expected an integer, read ''"
    assert not rd.transient


# ------------------------------------------------------------------ retried, unverified


def test_a_write_the_card_ignores_once_is_retried_after_the_backoff(rig):
    r = rig()
    r.gpu().faults.ignore_next.add("stage")
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.verified, res.attempts, res.message) == ("ok", True, 2, "read back equal after 2 attempt(s)")
    assert res.errors == ("read back differs: sclk_offset_mhz wrote -500 read 0",)
    assert res.written == PLANNED + PLANNED
    assert r.sleeps == [0.5]


def test_a_card_that_never_takes_the_offset_is_unverified_after_every_retry(rig):
    r = rig(retries=3, backoff=0.25)
    r.gpu().faults.ignore_next.add("stage")
    r.on_sleep = lambda s: r.gpu().faults.ignore_next.add("stage")
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    differs = "read back differs: sclk_offset_mhz wrote -500 read 0"
    assert (res.result, res.verified, res.attempts) == ("mismatch", False, 4)
    assert res.errors == (differs,) * 4
    assert res.message == f"still wrong after 4 attempt(s): {differs}"
    assert r.sleeps == [0.25, 0.5, 1.0]
    assert res.readback == {**AFTER, "sclk_offset_mhz": 0}
    assert r.audit[-2] == {"action": "unverified", "who": "test", "why": "why", "gpu": "r9700-a", "bdf": BDF,
                           "profile": "psu-safe", "readback": {**AFTER, "sclk_offset_mhz": 0},
                           "reason": f"still wrong after 4 attempt(s): {differs}"}
    ev = result_event(res)
    assert (ev.kind, ev.severity, dict(ev.fields)) == (
        "profile_unverified", "alert", {"profile": "psu-safe", "result": "mismatch", "errors": [differs] * 4})
    assert ev.message == f"profile psu-safe on r9700-a ({BDF}) NOT verified (mismatch): still wrong after 4 attempt(s): {differs}"


def test_no_retries_means_one_attempt(rig):
    r = rig(retries=0)
    r.gpu().faults.ignore_next.add("stage")
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.attempts, r.sleeps) == ("mismatch", 1, [])


def test_a_mismatch_names_what_it_read_when_a_value_is_missing(rig):
    """The read-back of the OD table failed: its values are absent, shown as `?`, with
    the read's error."""
    r = rig(retries=0)
    real = r.root.read_bytes

    def od_fails_after_writing(rel):
        if rel == OD and any(v == "c" for _, v, _ in r.root.writes):
            raise SysfsError(rel, errno.EIO)
        return real(rel)

    r.root.read_bytes = od_fails_after_writing
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert res.result == "mismatch"
    assert res.errors == (f"read back differs: sclk_offset_mhz wrote -500 read ?, vddgfx_offset_mv wrote -100 read ? "
                          f"(read {OD}: EIO (Input/output error))",)


def test_a_setting_this_kernel_cannot_print_is_never_verified(rig):
    r = rig(host=SimHost.incident(era="6.12"))
    res = r.applier.apply(T, "psu-safe", Profile(sclk_offset_mhz=-500), "test", "why")
    msg = ("sclk_offset_mhz cannot be read back on this kernel (SMU14 before d9d4cb224e41 prints the firmware limits "
           "instead of the setting): unverified")
    assert (res.result, res.verified, res.message, res.attempts, res.errors) == ("mismatch", False, msg, 1, ())
    assert res.written == ("pp_od_clk_voltage: s 1 -500", "pp_od_clk_voltage: c")
    assert [a for a in r.audit if a["action"] != "write"] == [
        {"action": "unverified", "who": "test", "why": "why", "gpu": "r9700-a", "bdf": BDF, "profile": "psu-safe",
         "readback": res.readback, "reason": msg}]
    assert r.sleeps == []  # nothing a retry could change


def test_an_unreadable_setting_with_a_real_mismatch_is_retried(rig):
    r = rig(host=SimHost.incident(era="6.12"), retries=1)
    r.gpu().faults.ignore_next.add("power_cap")
    r.on_sleep = lambda s: r.gpu().faults.ignore_next.add("power_cap")
    res = r.applier.apply(T, "psu-safe", Profile(sclk_offset_mhz=-500, power_cap_w=210), "test", "why")
    assert (res.result, res.attempts) == ("mismatch", 2)
    assert res.message == "still wrong after 2 attempt(s): read back differs: power_cap_w wrote 210 read 300"


# ------------------------------------------------------------------ lost, refused, gone


@pytest.mark.parametrize("how", ["lost", "absent", "refused"])
def test_a_gpu_that_may_not_be_written_gets_nothing(rig, how):
    kw = {"lost": {"is_lost": lambda b: b == BDF}, "refused": {"may_write": lambda b: b != BDF}, "absent": {}}[how]
    r = rig(**kw)
    target = CardTarget("r9700-a", "0000:77:00.0") if how == "absent" else T
    res = r.applier.apply(target, "psu-safe", PSU, "test", "why")
    assert res == CardResult("r9700-a", target.bdf, "psu-safe", "lost", False,
                             f"r9700-a ({target.bdf}) may not be written now (lost, not answering, not identified, "
                             "or the daemon is stopping); nothing written")
    assert r.root.writes == [] and r.audit == []


def test_gpu_lost_during_the_backoff(rig):
    lost = set()
    r = rig(is_lost=lambda b: b in lost)
    r.gpu().faults.ignore_next.add("stage")
    r.on_sleep = lambda s: lost.add(BDF)
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.verified, res.attempts, res.message) == (
        "lost", False, 2, "GPU lost during apply; writing stopped")
    assert res.written == PLANNED and res.errors == ("read back differs: sclk_offset_mhz wrote -500 read 0",)
    assert r.root.ok() == [(CONTROL, "on"), (OD, "s -500"), (OD, "vo -100"), (OD, "c"), (CAP, "210000000")]


def test_refused_between_two_writes_stops_there(rig):
    allowed = {"n": 3}  # _run's check, the wake, the first OD write

    def may_write(bdf):
        allowed["n"] -= 1
        return allowed["n"] >= 0

    r = rig(may_write=may_write)
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    text = (f"not written 'vo -100' to {OD}: r9700-a ({BDF}) may not be written now (lost, not answering, not "
            "identified, the daemon is stopping, or its apply was abandoned)")
    assert (res.result, res.verified, res.attempts, res.message, res.errors) == ("lost", False, 1, text, (text,))
    assert res.written == ("pp_od_clk_voltage: s -500",)
    assert r.root.writes == [(CONTROL, "on", 0), (OD, "s -500", 0)]  # not even the runtime-PM restore
    assert [a["value"] for a in r.audit] == ["on", "s -500"]  # a write never made is not audited as one


def test_card_gone_from_the_bus_mid_apply_is_lost(rig):
    r = rig()
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] == 4:  # before the second OD write
            r.host.lose_gpu(BDF, steps_before_removal=0)
        return True

    r.applier.may_write = may_write
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.attempts, res.written) == ("lost", 1, ("pp_od_clk_voltage: s -500",))
    assert res.message == f"write 'vo -100' to {OD}: ENOENT (No such file or directory)"
    assert r.sleeps == []


def test_a_file_gone_while_the_card_is_there_is_an_error(rig):
    r = rig()
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] == 6:  # before the power cap: hwmon4 is renumbered under us
            r.host.renumber_hwmon()
        return True

    r.applier.may_write = may_write
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.attempts) == ("error", 1)
    assert res.message == f"write '210000000' to {CAP}: ENOENT (No such file or directory)"
    assert res.written == PLANNED[:3]


def test_hwmon_gone_before_the_writes(rig):
    r = rig()
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] == 2:  # the wake write: hwmon is looked up again after it
            r.host.garbage(BDF, "name", "nct6798\n")
        return True

    r.applier.may_write = may_write
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.message, res.written) == ("error", "power1_cap: 210000000: no amdgpu hwmon folder",
                                                      PLANNED[:3])


def test_a_refused_write_is_not_retried_and_names_errno_and_kernel_log(rig):
    r = rig()
    reading = r.applier.read(T)
    plan = plan_apply("r9700-a", "psu-safe", PSU, reading.od, reading.cap)
    r.host.lose_gpu(BDF, steps_before_removal=5)  # fallen off the bus, still bound: OD writes fail EINVAL
    res = r.applier._execute(T, plan, reading.values(), "test", "why")
    text = f"write 's -500' to {OD}: EINVAL (Invalid argument); kernel log: no reason logged"
    assert (res.result, res.attempts, res.message, res.errors, res.written) == ("error", 1, text, (text,), ())
    assert r.audit == [{"action": "write", "who": "test", "why": "why", "gpu": "r9700-a", "bdf": BDF, "file": OD,
                        "value": "s -500", "result": "error", "error": text}]
    assert r.sleeps == []


def test_without_a_readable_kernel_log_the_reason_says_why(tmp_path):
    r = Rig(tmp_path, kmsg=False)
    reading = r.applier.read(T)
    plan = plan_apply("r9700-a", "psu-safe", Profile(sclk_offset_mhz=-500), reading.od, reading.cap)
    r.host.lose_gpu(BDF, steps_before_removal=5)
    res = r.applier._execute(T, plan, reading.values(), "test", "why")
    assert res.message == (f"write 's -500' to {OD}: EINVAL (Invalid argument); kernel log: cannot read the kernel "
                           f"log {tmp_path}/dev/kmsg: No such file or directory")


def test_a_card_busy_resetting_is_retried_until_it_answers(rig):
    r = rig()
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] == 3:  # the cap write, after the wake: the card starts a reset
            r.host.reset_gpu(BDF, steps=1)
        return True

    r.applier.may_write = may_write
    r.on_sleep = lambda s: r.host.step(1.0)
    res = r.applier.apply(T, "cap", Profile(power_cap_w=250), "test", "why")
    assert (res.result, res.attempts, r.sleeps) == ("ok", 2, [0.5])
    assert res.errors == (f"write '250000000' to {CAP}: EPERM (Operation not permitted)",)
    assert res.written == ("power1_cap: 250000000",)


def test_errno_text():
    from gpuguard.profiles.apply import _errno_text

    assert _errno_text(errno.EINVAL) == "EINVAL (Invalid argument)"
    assert _errno_text(4242) == "4242 (Unknown error 4242)"


def test_without_a_kernel_reason_given_the_kernel_log_is_read(tmp_path):
    """`gpuguard apply` builds the applier without one: the default reads `dev/kmsg`."""
    host = SimHost.incident()
    a = Applier(SimRoot(host, str(tmp_path)), sleep=lambda s: None)
    assert isinstance(a.kernel_reason, KmsgReasons)
    reading = a.read(T)
    plan = plan_apply("r9700-a", "psu-safe", Profile(sclk_offset_mhz=-500), reading.od, reading.cap)
    host.lose_gpu(BDF, steps_before_removal=5)
    res = a._execute(T, plan, reading.values(), "test", "why")
    assert res.message.endswith(f"kernel log: cannot read the kernel log {tmp_path}/dev/kmsg: No such file or directory")


# ------------------------------------------------------------------ before writing


def test_od_table_that_cannot_be_parsed(rig):
    r = rig()
    r.host.garbage(BDF, "pp_od_clk_voltage", "OD_SCLK:\n0: ???\n")
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert res.result == "error" and not res.verified
    assert res.message == f"cannot read the OD table: {res.errors[0]}"
    assert res.before == {"power_cap_w": 300, "performance_level": "auto"}
    assert r.root.writes == []


def test_plan_refusal_writes_nothing(rig):
    r = rig()
    res = r.applier.apply(T, "bad", Profile(sclk_offset_mhz=-600), "test", "why")
    msg = "r9700-a: sclk_offset_mhz=-600 MHz refused: outside the card's OD_RANGE -500…1000 MHz"
    assert res == CardResult("r9700-a", BDF, "bad", "refused", False, msg, before=BEFORE, errors=(msg,))
    assert r.root.writes == [] and result_event(res).kind == "profile_unverified"


def test_dry_run_plans_and_writes_nothing(rig):
    r = rig()
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why", dry_run=True)
    assert res == CardResult("r9700-a", BDF, "psu-safe", "dry-run", False, "dry run: nothing written", before=BEFORE,
                             planned=PLANNED, expected=EXPECTED)
    assert r.root.writes == [] and result_event(res) is None
    # a sleeping card is not woken for a dry run
    assert r.host.suspend(BDF)
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why", dry_run=True)
    assert r.root.writes == [] and res.message.startswith("cannot read the OD table: ")


def test_a_suspended_card_is_woken_before_it_is_read_again(rig):
    r = rig()
    assert r.host.suspend(BDF)
    first = r.applier.read(T)
    assert first.transient and first.runtime_status == "suspended" and first.od is None
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert res.verified and res.before == BEFORE
    assert r.root.ok()[0] == (CONTROL, "on") and r.root.ok()[-1] == (CONTROL, "auto")
    assert [p for p, _ in r.root.ok()].count(CONTROL) == 2


def test_reset_puts_stock_back(rig):
    r = rig()
    assert r.applier.apply(T, "psu-safe", PSU, "test", "why").verified
    r.root.writes.clear()
    res = r.applier.reset(T, "test", "back to stock")
    assert (res.result, res.profile, res.verified, res.written) == (
        "ok", "stock", True, ("pp_od_clk_voltage: r", "power1_cap: 300000000"))
    assert dict(res.expected) == {"sclk_offset_mhz": 0, "vddgfx_offset_mv": 0, "power_cap_w": 300}
    assert r.root.ok() == [(CONTROL, "on"), (OD, "r"), (CAP, "300000000"), (CONTROL, "auto")]


# ------------------------------------------------------------------ more ends, exactly


def _gone_mid_apply(r, at_call: int, **lose) -> None:
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] == at_call:
            r.host.lose_gpu(BDF, **lose)
        return True

    r.applier.may_write = may_write


def test_card_gone_mid_apply_is_never_verified(rig):
    r = rig()
    _gone_mid_apply(r, 4, steps_before_removal=0)  # before the second OD write
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    text = f"write 'vo -100' to {OD}: ENOENT (No such file or directory)"
    assert (res.result, res.verified, res.written, res.errors, res.message) == (
        "lost", False, ("pp_od_clk_voltage: s -500",), (text,), text)


def test_card_in_trouble_mid_apply_stops_with_what_it_wrote(rig):
    r = rig()
    _gone_mid_apply(r, 4, steps_before_removal=5)  # fallen off, still bound: EINVAL, reads fail EIO
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    text = f"write 'vo -100' to {OD}: EINVAL (Invalid argument); kernel log: no reason logged"
    assert (res.result, res.verified, res.attempts, res.written, res.errors, res.message) == (
        "error", False, 1, ("pp_od_clk_voltage: s -500",), (text,), text)


def test_a_value_the_card_refuses_stops_the_apply_and_reads_the_card_back(rig):
    """The card's own check refuses what ours let through (a plan built past validation):
    EINVAL, no retry, and the result shows what the card holds now."""
    from gpuguard.profiles.plan import Plan, Write

    r = rig()
    plan = Plan("r9700-a", "x", "rdna4", (Write("pp_od_clk_voltage", "s -500", "sclk_offset_mhz"),
                                          Write("pp_od_clk_voltage", "vo -300", "vddgfx_offset_mv"),
                                          Write("pp_od_clk_voltage", "c")), {"vddgfx_offset_mv": -300})
    res = r.applier._execute(T, plan, BEFORE, "test", "why")
    text = f"write 'vo -300' to {OD}: EINVAL (Invalid argument); kernel log: no reason logged"
    assert (res.result, res.verified, res.attempts, res.written, res.errors, res.message) == (
        "error", False, 1, ("pp_od_clk_voltage: s -500",), (text,), text)
    assert res.readback == {**BEFORE, "sclk_offset_mhz": -500}  # staged, shown, not committed by us


def test_a_kernel_reason_given_as_a_plain_function(rig):
    """`kernel_reason(bdf, since) -> str | None` may be any callable: one without KmsgReasons'
    `mark()` and `error` is called with the time of the write."""
    r = rig()
    seen = []

    def reason(bdf, since):
        seen.append((bdf, type(since)))
        return "GfxclkFmax (3000) must be within [500, 2900]!" if len(seen) == 1 else None

    r.applier.kernel_reason = reason
    reading = r.applier.read(T)
    plan = plan_apply("r9700-a", "psu-safe", Profile(sclk_offset_mhz=-500), reading.od, reading.cap)
    r.host.lose_gpu(BDF, steps_before_removal=5)
    res = r.applier._execute(T, plan, reading.values(), "test", "why")
    assert res.message == (f"write 's -500' to {OD}: EINVAL (Invalid argument); kernel log: GfxclkFmax (3000) must be "
                           "within [500, 2900]!")
    assert seen == [(BDF, float)]
    res = r.applier._execute(T, plan, reading.values(), "test", "why")
    assert res.message == f"write 's -500' to {OD}: EINVAL (Invalid argument); kernel log: no reason logged"


def test_every_attempt_busy_ends_unverified_with_the_last_error(rig):
    r = rig(retries=2)
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] >= 3:  # every cap write, after the wake
            r.host.reset_gpu(BDF, steps=1)
        return True

    r.applier.may_write = may_write
    r.on_sleep = lambda s: r.host.step(1.0)
    res = r.applier.apply(T, "cap", Profile(power_cap_w=250), "test", "why")
    busy = f"write '250000000' to {CAP}: EPERM (Operation not permitted)"
    assert (res.result, res.verified, res.attempts, res.written, dict(res.readback), res.errors) == (
        "mismatch", False, 3, (), {}, (busy,) * 3)
    assert res.message == f"still wrong after 3 attempt(s): {busy}"
    assert r.sleeps == [0.5, 1.0]


def test_an_unreadable_setting_after_a_busy_first_attempt_keeps_that_error(rig):
    r = rig(host=SimHost.incident(era="6.12"))
    calls = {"n": 0}

    def may_write(bdf):
        calls["n"] += 1
        if calls["n"] == 3:  # the first OD write
            r.host.reset_gpu(BDF, steps=1)
        return True

    r.applier.may_write = may_write
    r.on_sleep = lambda s: r.host.step(1.0)
    res = r.applier.apply(T, "psu-safe", Profile(sclk_offset_mhz=-500), "test", "why")
    assert (res.result, res.attempts) == ("mismatch", 2)
    assert res.errors == (f"write 's 1 -500' to {OD}: EPERM (Operation not permitted)",)
    assert res.message.endswith("cannot be read back on this kernel (SMU14 before d9d4cb224e41 prints the firmware "
                                "limits instead of the setting): unverified")


def test_an_empty_profile_writes_nothing_and_reads_back_equal(rig):
    r = rig()
    res = r.applier.apply(T, "empty", Profile(), "test", "why")
    assert (res.result, res.verified, res.planned, res.written, res.attempts) == ("ok", True, (), (), 1)
    assert r.root.ok() == [(CONTROL, "on"), (CONTROL, "auto")]


def test_persistent_mismatch_keeps_what_it_wrote(rig):
    r = rig(retries=1)
    r.gpu().faults.ignore_next.add("stage")
    r.on_sleep = lambda s: r.gpu().faults.ignore_next.add("stage")
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    assert (res.result, res.written) == ("mismatch", PLANNED + PLANNED)


def test_unparsable_od_table_result_exactly(rig):
    r = rig()
    r.host.garbage(BDF, "pp_od_clk_voltage", "OD_SCLK:\n0: ???\n")
    res = r.applier.apply(T, "psu-safe", PSU, "test", "why")
    err = res.errors[0]
    assert res == CardResult("r9700-a", BDF, "psu-safe", "error", False, f"cannot read the OD table: {err}",
                             before={"power_cap_w": 300, "performance_level": "auto"}, errors=(err,))


def test_every_problem_of_a_refused_plan_is_in_the_message(rig):
    r = rig()
    res = r.applier.apply(T, "bad", Profile(sclk_offset_mhz=-600, vddgfx_offset_mv=-300), "test", "why")
    problems = ("r9700-a: sclk_offset_mhz=-600 MHz refused: outside the card's OD_RANGE -500…1000 MHz",
                "r9700-a: vddgfx_offset_mv=-300 mV refused: outside the card's OD_RANGE -200…0 mV")
    assert (res.result, res.message, res.errors) == ("refused", "; ".join(problems), problems)


def test_a_card_without_od_names_the_kernel_parameter(tmp_path):
    host = SimHost.incident(od_enabled=False)
    root = SimRoot(host, str(tmp_path))
    res = Applier(root, sleep=lambda s: None).apply(T, "psu-safe", PSU, "test", "why")
    assert res.result == "od_disabled"
    assert res.message.startswith("r9700-a: cannot set sclk_offset_mhz, vddgfx_offset_mv: ")
    assert "amdgpu.ppfeaturemask=" in res.message and "pp_od_clk_voltage is missing" not in res.message


def test_waking_waits_for_the_card_to_be_active(rig):
    r = rig()
    r.host.suspend(BDF)
    states = iter(["suspended", "suspended", "suspended"])
    real = r.root.read_bytes

    def runtime_status(rel):
        if rel.endswith("/power/runtime_status") and any(v == "on" for _, v, _ in r.root.writes):
            return (next(states, "active") + "\n").encode()
        return real(rel)

    r.root.read_bytes = runtime_status
    assert r.applier.apply(T, "cap", Profile(power_cap_w=250), "test", "why").verified
    assert r.sleeps == [0.02, 0.02, 0.02]
    assert r.root.ok()[-1] == (CONTROL, "auto")
    assert r.audit[0] == _write(CONTROL, "on", "keep the card awake while applying (why)")


def test_a_card_whose_runtime_status_cannot_be_read_while_waking_is_still_put_back(rig):
    """The wait for `active` ends at the first unreadable runtime_status; the card was
    woken all the same, so its power control is restored after the apply."""
    r = rig()
    real = r.root.read_bytes

    def runtime_status_fails_once_woken(rel):
        if rel.endswith("/power/runtime_status") and r.root.writes:
            raise SysfsError(rel, errno.EIO)
        return real(rel)

    r.root.read_bytes = runtime_status_fails_once_woken
    assert r.applier.apply(T, "cap", Profile(power_cap_w=250), "test", "why").verified
    assert r.sleeps == []
    assert r.root.ok() == [(CONTROL, "on"), (CAP, "250000000"), (CONTROL, "auto")]


@pytest.mark.slow
def test_waking_gives_up_after_two_seconds(rig):
    """A card that never says `active`: the default wait is 2 s, then the apply goes on."""
    import time

    r = rig(sleep=time.sleep)
    r.host.suspend(BDF)
    real = r.root.read_bytes
    r.root.read_bytes = lambda rel: b"suspended\n" if rel.endswith("/power/runtime_status") else real(rel)
    t0 = time.monotonic()
    old = r.applier._wake(T, "test", "why")
    took = time.monotonic() - t0
    assert old == "auto" and 2.0 <= took < 2.9, took


def test_reset_is_audited_and_refused_like_an_apply(rig):
    r = rig()
    assert r.applier.apply(T, "psu-safe", PSU, "test", "why").verified
    r.audit.clear()
    res = r.applier.reset(T, "ops", "back to stock")
    assert res.verified and [(a["action"], a["who"], a["why"]) for a in r.audit] == [
        ("write", "ops", "keep the card awake while applying (back to stock)"), ("write", "ops", "back to stock"),
        ("write", "ops", "back to stock"), ("verified", "ops", "back to stock"),
        ("write", "ops", "restore runtime power management")]
    dry = r.applier.reset(T, "ops", "why", dry_run=True)
    assert (dry.result, dry.profile, dry.planned) == ("dry-run", "stock", ("pp_od_clk_voltage: r", "power1_cap: 300000000"))
    r.applier.is_lost = lambda b: True
    assert (r.applier.reset(T, "ops", "why").result, r.applier.reset(T, "ops", "why").profile) == ("lost", "stock")


def test_nothing_to_reset_names_the_card(tmp_path):
    (tmp_path / DEV.lstrip("/")).mkdir(parents=True)
    res = Applier(SysfsRoot(str(tmp_path))).reset(T, "ops", "why")
    assert (res.result, res.profile, res.message) == (
        "config", "stock", "r9700-a: nothing to reset (no OD table and no power1_cap_default)")


def test_a_sleeping_card_is_woken_with_who_and_why(rig):
    r = rig()
    assert r.host.suspend(BDF)
    assert r.applier.apply(T, "psu-safe", PSU, "ops", "boot").verified
    assert r.audit[0] == {"action": "write", "who": "ops", "why": "keep the card awake while applying (boot)",
                          "gpu": "r9700-a", "bdf": BDF, "file": CONTROL, "value": "on", "result": "ok"}


def test_unverified_event_names_its_card(rig):
    r = rig()
    res = r.applier.apply(T, "bad", Profile(sclk_offset_mhz=-600), "test", "why")
    ev = result_event(res, source="lifecycle")
    assert (ev.kind, ev.source, ev.gpu, ev.bdf) == ("profile_unverified", "lifecycle", "r9700-a", BDF)
