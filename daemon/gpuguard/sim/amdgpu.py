"""The simulated amdgpu driver for one GPU: its state and its sysfs files.

Owns: device attributes (`gpu_busy_percent`, `mem_info_*`, `pp_dpm_*`,
`pp_od_clk_voltage`, `power_dpm_force_performance_level`, `vbios_version`, `unique_id`,
`power/*`) and hwmon attributes (power, temps, clocks, voltage, fan), rendered on read
from the model state like a show() function and written through the kernel's parsing
and checks (amdgpu-od-protocol.md §1–§5). Errors are `OSError(errno)` exactly where the
kernel returns one; reasons the driver only logs go to the kernel log.

Access gate (§1.4, per KernelEra): while a reset is in progress PM files fail with
EPERM (≤ 6.14) / EBUSY (7.0); a runtime-suspended card wakes on a read (6.12) or refuses
it with EPERM (6.14) / EBUSY (7.0); writes wake it (or fail with `resume_error`).
"""
from __future__ import annotations

import copy
import errno
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Callable

from .cards import CardModel, KernelEra
from .kmsg import KERN_ERR, KERN_INFO, KERN_WARNING, KernelLog
from .load import LoadModel, Sensors
from .od import Navi2xOd, OdRefused, OdTable, Smu13Od, Smu14Od, kstrtol, parse_command
from .topology import PciFunction

PERF_LEVELS = ("low", "high", "auto", "manual", "profile_exit", "profile_standard",
               "profile_min_sclk", "profile_min_mclk", "profile_peak", "perf_determinism")
DPM_FILES = ("pp_dpm_sclk", "pp_dpm_mclk", "pp_dpm_socclk", "pp_dpm_fclk", "pp_dpm_pcie")


def oserror(err: int, what: str = "") -> OSError:
    import os
    return OSError(err, os.strerror(err), what or None)


@dataclass
class FileDef:
    """One sysfs attribute: render() → bytes; write(data) or None (read-only);
    `gated`: goes through the PM access gate (touches the SMU)."""

    render: Callable[[], bytes]
    write: Callable[[bytes], None] | None = None
    gated: bool = False
    mode: int = 0o444

    def __post_init__(self) -> None:
        if self.write is not None and self.mode == 0o444:
            self.mode = 0o644


def make_od(model: CardModel, era: KernelEra) -> OdTable:
    if model.od_family == "smu14":
        return Smu14Od(model.od_boot, model.od_ranges, fixed_format=era.smu14_fixed_format)
    if model.od_family == "smu13":
        return Smu13Od(model.od_boot, model.od_ranges, vddc_curve=era.smu13_vddc_curve)
    return Navi2xOd(model.od_boot, model.od_ranges)


@dataclass
class Faults:
    """Fault injection state of one GPU (see faults.py for the host-level API)."""

    garbage: dict = field(default_factory=dict)        # file name → bytes
    blocked: dict = field(default_factory=dict)        # file name → threading.Event
    blocked_writes: dict = field(default_factory=dict)  # file name → threading.Event (a store() that hangs)
    ignore_next: set = field(default_factory=set)      # {"commit", "stage", "power_cap"}
    lost_stage: int = 0                                # 0 ok, 1 failing, 2 removed
    lost_errno: int = errno.EIO
    removal_in: int = 1                                # steps until a lost GPU leaves the tree
    resume_error: int | None = None


class AmdGpu:
    def __init__(self, fn: PciFunction, era: KernelEra, log: KernelLog, od_enabled: bool, seed: int):
        assert fn.model is not None
        self.fn = fn
        self.bdf = fn.bdf
        # the chip's serial: the card's own, it stays when the card moves to another slot
        self.serial = hashlib.sha256(fn.bdf.encode()).hexdigest()[:16]
        self.model: CardModel = fn.model
        self.era = era
        self.log = log
        self.od_enabled = od_enabled
        self.od: OdTable = make_od(self.model, era)
        self.power_cap_w = self.model.power_default_w
        self.enforced_cap_w = self.model.power_default_w
        self.perf_level = "auto"
        self.dpm_masks: dict[str, int] = {}
        self.load_level = 0.0
        self.vram_used = 312 * (1 << 20)
        self.runtime_control = "auto"
        self.suspended = False
        self.reset_steps = 0
        self.resets = 0
        self.faults = Faults()
        self.present = True
        self.card_index: int | None = None
        self.hwmon_index: int | None = None
        self.hold_sensors = False          # tests set sensors by hand and freeze them
        self.load_model = LoadModel(self.model, seed)
        self.sensors: Sensors = self.load_model.sensors
        self.slot_link = (16.0, 16)        # (GT/s, width) the SMU sees; set by the host
        self.pcie_cap = 16.0               # partner port capability caps pp_dpm_pcie
        self.step(0.0)

    # -- limits -----------------------------------------------------------------------
    @property
    def power_cap_max_w(self) -> int:
        # SMU13: the OD headroom above the default only exists with OD enabled (§4).
        if self.model.od_family == "smu13" and not self.od_enabled:
            return self.model.power_default_w
        return self.model.power_max_w

    @property
    def vis_vram_total(self) -> int:
        return min(self.model.vram_total, self.model.bar0_size)

    @property
    def vis_vram_used(self) -> int:
        if self.vis_vram_total >= self.model.vram_total:
            return self.vram_used
        return min(self.vis_vram_total, 23 * (1 << 20) + self.vram_used // 4096)

    # -- time -------------------------------------------------------------------------
    def step(self, dt: float) -> None:
        if self.reset_steps > 0 and dt > 0:
            self.reset_steps -= 1
            if self.reset_steps == 0:
                self.log.add(KERN_INFO, f"amdgpu {self.bdf}: GPU reset({self.resets}) succeeded!", self.bdf)
        if self.hold_sensors:
            return
        self.load_model.step(dt, self.load_level if not self.suspended else 0.0, self.od.effective(),
                             self.model.od_family, self.enforced_cap_w, self.perf_level)

    # -- gate -------------------------------------------------------------------------
    def check_read(self, gated: bool) -> None:
        st = self.faults.lost_stage
        if st == 1 and gated:
            raise oserror(self.faults.lost_errno)
        if st >= 2:
            raise oserror(errno.ENODEV)
        if not gated:
            return
        if self.reset_steps > 0:
            raise oserror(self.era.busy_errno)
        if self.suspended:
            err = self.era.suspended_read_errno
            if err is not None:
                raise oserror(err)
            self.suspended = False     # K611: pm_runtime_get_sync() wakes the GPU

    def check_write(self, name: str) -> None:
        st = self.faults.lost_stage
        if st == 1:
            # Fallen off the bus, still bound: SMU messages fail; pp_od_clk_voltage
            # flattens every failure to EINVAL (§1.2, §5).
            raise oserror(errno.EINVAL if name == "pp_od_clk_voltage" else self.faults.lost_errno)
        if st >= 2:
            raise oserror(errno.ENODEV)
        if self.reset_steps > 0:
            raise oserror(self.era.busy_errno)
        if self.suspended:
            if self.faults.resume_error is not None:
                raise oserror(self.faults.resume_error)   # LACT #1057: EIO at boot
            self.suspended = False     # pm_runtime_resume_and_get()

    def dev(self, level: int = KERN_INFO) -> Callable[[str], None]:
        return lambda msg: self.log.add(level, f"amdgpu {self.bdf}: {msg}", self.bdf)

    # -- writes -----------------------------------------------------------------------
    def write_od(self, data: bytes) -> None:
        if not self.od_enabled:
            raise oserror(errno.EINVAL)
        try:
            cmd, params = parse_command(data)
            if cmd in ("s", "m", "vo", "vc") and "stage" in self.faults.ignore_next:
                self.faults.ignore_next.discard("stage")
                copy.deepcopy(self.od).edit(cmd, params, self.dev())   # still validated
                return
            if cmd == "c" and "commit" in self.faults.ignore_next and self.od.staged != self.od.active:
                self.faults.ignore_next.discard("commit")
                self.od.staged = dict(self.od.active)   # the upload was lost
                return
            before = dict(self.od.active)
            self.od.edit(cmd, params, self.dev())
            if cmd in ("c", "r") and self.od.active != before and self.model.od_family == "smu13":
                # LACT #430/#506: after an OD upload the SMU13 card enforces its default
                # PPT until power1_cap is written again (the displayed value is unchanged).
                self.enforced_cap_w = self.model.power_default_w
        except OdRefused as e:
            raise oserror(e.errno) from None

    def write_power_cap(self, data: bytes) -> None:
        text = data.decode("latin-1")
        s = text[:-1] if text.endswith("\n") else text
        s = s[1:] if s.startswith("+") else s
        if not s or not s.isdigit():
            raise oserror(errno.EINVAL)          # kstrtou32: not a number / negative
        value = int(s)
        if value > 0xFFFFFFFF:
            raise oserror(errno.ERANGE)
        watts = value // 1_000_000               # truncated to whole watts
        lo, hi = self.model.power_min_w, self.power_cap_max_w
        if watts < lo or watts > hi:
            self.log.add(KERN_ERR, f"amdgpu {self.bdf}: New power limit ({watts}) is out of range [{lo},{hi}]", self.bdf)
            raise oserror(errno.EINVAL)
        if watts == 0:
            return                               # 0 = keep the current limit
        if "power_cap" in self.faults.ignore_next:
            self.faults.ignore_next.discard("power_cap")
            return
        self.power_cap_w = watts
        self.enforced_cap_w = watts

    def write_perf_level(self, data: bytes) -> None:
        text = data.decode("latin-1")
        level = None
        if self.era.level_prefix_match:
            for word in PERF_LEVELS:            # strncmp(buf, word, strlen(word))
                if text.startswith(word):
                    level = word
                    break
        else:
            word = text[:-1] if text.endswith("\n") else text   # sysfs_streq
            level = word if word in PERF_LEVELS else None
        if level is None or level == "perf_determinism":        # not on SMU13/14 dGPUs
            raise oserror(errno.EINVAL)
        if level == "profile_exit":
            level = "auto"
        if self.perf_level == "manual" and level != "manual":
            self.dpm_masks.clear()   # leaving manual clears the forced clock masks
        self.perf_level = level

    def write_dpm(self, name: str, data: bytes) -> None:
        mask = 0
        text = data.decode("latin-1")
        for tok in text.replace("\n", " ").split(" "):
            if not tok:
                break                # amdgpu_read_mask stops at the first empty token
            try:
                level = kstrtol(tok)
            except ValueError:
                raise oserror(errno.EINVAL) from None
            if level < 0 or level > 31:
                raise oserror(errno.EINVAL)
            mask |= 1 << level
        if self.perf_level != "manual":
            # smu_force_smuclk_levels: "force clock level is for dpm manual mode only."
            raise oserror(errno.EINVAL)
        count = {"pp_dpm_sclk": 2,   # fine-grained SCLK only knows levels 0 and 1
                 "pp_dpm_mclk": len(self.model.mclk_levels),
                 "pp_dpm_socclk": 2 if self.model.socclk_fine else len(self.model.socclk_levels),
                 "pp_dpm_fclk": 2 if self.model.fclk_fine else len(self.model.fclk_levels),
                 "pp_dpm_pcie": len(self.model.pcie_levels)}[name]
        if mask and mask.bit_length() > count:
            raise oserror(errno.EINVAL)
        # Accepted, and changes nothing the card does (INCIDENTS §2: "silently ignored").
        self.dpm_masks[name] = mask

    def write_runtime_control(self, data: bytes) -> None:
        word = data.decode("latin-1").strip()
        if word not in ("on", "auto"):
            raise oserror(errno.EINVAL)
        self.runtime_control = word
        if word == "on":
            self.suspended = False

    # -- renderers --------------------------------------------------------------------
    def render_dpm(self, levels: tuple, cur: int, fine: bool) -> bytes:
        if fine:
            lo, hi = levels[0], levels[-1]
            if cur != lo and cur != hi and self.model.od_family == "navi2x":
                # sienna_cichlid prints the fake middle level with the "%s" marker field.
                return f"0: {lo}Mhz \n1: {cur}Mhz *\n2: {hi}Mhz \n".encode()
            if cur != lo and cur != hi:
                return f"0: {lo}Mhz\n1: {cur}Mhz *\n2: {hi}Mhz\n".encode()
            return (f"0: {lo}Mhz {'*' if cur == lo else ''}\n"
                    f"1: {hi}Mhz {'*' if cur == hi else ''}\n").encode()
        out = []
        best = min(range(len(levels)), key=lambda i: abs(levels[i] - cur))
        for i, v in enumerate(levels):
            out.append(f"{i}: {v}Mhz {'*' if i == best else ''}\n")
        return "".join(out).encode()

    def pcie_levels(self) -> list[tuple[str, str, int]]:
        out = []
        for gen, width, mhz in self.model.pcie_levels:
            g = float(gen.split("GT")[0])
            if g > self.pcie_cap:
                gen = f"{self.pcie_cap:.1f}GT/s"
            out.append((gen, width, mhz))
        return out

    def render_pcie(self) -> bytes:
        cur_gen = f"{min(self.slot_link[0], self.pcie_cap):.1f}GT/s"
        cur_w = f"x{self.slot_link[1]}"
        out = []
        for i, (gen, width, mhz) in enumerate(self.pcie_levels()):
            mark = "*" if gen == cur_gen and width == cur_w else ""
            out.append(f"{i}: {gen}, {width} {mhz}Mhz {mark}\n")
        return "".join(out).encode()

    def unique_id(self) -> bytes:
        return (self.serial + "\n").encode()

    def device_files(self) -> dict[str, FileDef]:
        s = self.sensors
        m = self.model
        num = lambda f: (lambda: f"{f()}\n".encode())  # noqa: E731
        files = {
            "gpu_busy_percent": FileDef(num(lambda: s.busy_pct), gated=True),
            "mem_busy_percent": FileDef(num(lambda: min(100, int(s.busy_pct * 0.6))), gated=True),
            "mem_info_vram_total": FileDef(num(lambda: m.vram_total)),
            "mem_info_vram_used": FileDef(num(lambda: self.vram_used)),
            "mem_info_vis_vram_total": FileDef(num(lambda: self.vis_vram_total)),
            "mem_info_vis_vram_used": FileDef(num(lambda: self.vis_vram_used)),
            "pp_dpm_sclk": FileDef(lambda: self.render_dpm((m.sclk_min, m.sclk_max), s.sclk_mhz, m.sclk_fine),
                                   lambda d: self.write_dpm("pp_dpm_sclk", d), gated=True),
            "pp_dpm_mclk": FileDef(lambda: self.render_dpm(m.mclk_levels, s.mclk_mhz, m.mclk_fine),
                                   lambda d: self.write_dpm("pp_dpm_mclk", d), gated=True),
            "pp_dpm_socclk": FileDef(lambda: self.render_dpm(m.socclk_levels, s.socclk_mhz, m.socclk_fine),
                                     lambda d: self.write_dpm("pp_dpm_socclk", d), gated=True),
            "pp_dpm_fclk": FileDef(lambda: self.render_dpm(m.fclk_levels, s.fclk_mhz, m.fclk_fine),
                                   lambda d: self.write_dpm("pp_dpm_fclk", d), gated=True),
            "pp_dpm_pcie": FileDef(self.render_pcie, lambda d: self.write_dpm("pp_dpm_pcie", d), gated=True),
            "power_dpm_force_performance_level": FileDef(lambda: f"{self.perf_level}\n".encode(),
                                                         self.write_perf_level, gated=True),
            "vbios_version": FileDef(lambda: f"{m.vbios}\n".encode()),
            "unique_id": FileDef(self.unique_id),
            "power/runtime_status": FileDef(lambda: b"suspended\n" if self.suspended else b"active\n"),
            "power/control": FileDef(lambda: f"{self.runtime_control}\n".encode(), self.write_runtime_control),
        }
        if self.od_enabled:
            files["pp_od_clk_voltage"] = FileDef(lambda: self.od.render(self.era.nul_gaps), self.write_od, gated=True)
        return files

    def hwmon_files(self) -> dict[str, FileDef]:
        s = self.sensors
        m = self.model
        const = lambda t: FileDef(lambda: t.encode())  # noqa: E731
        sensor = lambda f: FileDef(lambda: f"{f()}\n".encode(), gated=True)  # noqa: E731
        files = {"name": const("amdgpu\n"), "power1_label": const("PPT\n")}
        if m.has_power_average:
            # the firmware's AverageSocketPower: a short window, transients included (load.py)
            files["power1_average"] = sensor(lambda: int(round(s.power_window_w)) * 1_000_000)
        if m.has_power_input:
            files["power1_input"] = sensor(lambda: int(round(s.power_input_w)) * 1_000_000)
        files.update({
            "power1_cap": FileDef(lambda: f"{self.power_cap_w * 1_000_000}\n".encode(), self.write_power_cap, gated=True),
            "power1_cap_max": sensor(lambda: self.power_cap_max_w * 1_000_000),
            "power1_cap_min": sensor(lambda: m.power_min_w * 1_000_000),
            "power1_cap_default": sensor(lambda: m.power_default_w * 1_000_000),
        })
        temps = (("edge", lambda: s.temp_edge_c), ("junction", lambda: s.temp_junction_c), ("mem", lambda: s.temp_mem_c))
        for i, ((label, val), (crit, emerg)) in enumerate(zip(temps, m.temp_limits), start=1):
            files[f"temp{i}_input"] = sensor(lambda v=val: int(round(v())) * 1000)
            files[f"temp{i}_label"] = const(f"{label}\n")
            files[f"temp{i}_crit"] = const(f"{crit}\n")
            files[f"temp{i}_crit_hyst"] = const("-273150\n")
            files[f"temp{i}_emergency"] = const(f"{emerg}\n")
        files.update({
            "freq1_input": sensor(lambda: s.sclk_mhz * 1_000_000), "freq1_label": const("sclk\n"),
            "freq2_input": sensor(lambda: s.mclk_mhz * 1_000_000), "freq2_label": const("mclk\n"),
            "in0_input": sensor(lambda: s.vddgfx_mv), "in0_label": const("vddgfx\n"),
            "fan1_input": sensor(lambda: s.fan_rpm), "fan1_min": const("0\n"),
            "fan1_max": const(f"{m.fan_max_rpm}\n"),
            "pwm1": sensor(lambda: int(round(255 * s.fan_rpm / m.fan_max_rpm))),
            "pwm1_enable": const("2\n"), "pwm1_min": const("0\n"), "pwm1_max": const("255\n"),
        })
        return files

    # -- faults -----------------------------------------------------------------------
    def reset(self, steps: int = 0) -> None:
        """A GPU reset: stock OD, default cap, auto level, silently (§2 persistence note)."""
        self.resets += 1
        self.log.add(KERN_WARNING, f"amdgpu {self.bdf}: amdgpu: GPU reset begin!", self.bdf)
        self.od.reset()
        self.power_cap_w = self.enforced_cap_w = self.model.power_default_w
        self.perf_level = "auto"
        self.dpm_masks.clear()
        self.reset_steps = steps
        if steps == 0:
            self.log.add(KERN_INFO, f"amdgpu {self.bdf}: GPU reset({self.resets}) succeeded!", self.bdf)

    def release_blocked(self) -> None:
        for ev in (*self.faults.blocked.values(), *self.faults.blocked_writes.values()):
            ev.set()


def new_blocker() -> threading.Event:
    return threading.Event()
