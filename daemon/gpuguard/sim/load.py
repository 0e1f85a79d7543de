"""The load model: per-GPU load level (0..1) → clocks, voltage, power, temperatures, fan,
busy %, honouring what the card actually runs (the *active* OD table, the enforced power
cap, the performance level).

Formulas (constants per card in cards.LoadParams):
  SCLK under full load  f_full = f_ref + offset              (RDNA4: OD_SCLK_OFFSET)
                        f_full = f_ref - slope·(boot_max - sclk_max)   (SMU13/Navi2x: OD_SCLK max)
  SCLK at load L        f = idle + (f_full - idle)·min(1, L/0.3)
  voltage               V = v_ref + v_per_mhz·(f - f_ref) + vddgfx_offset
  power                 P = idle_w + L·(mem_w·m + k_dyn·f·V²),   m = MCLK share
  power cap             if P > cap, f is lowered (bisection) until P == cap
  temperatures          first-order lag (τ = 4 s) towards ambient + r·P
  transients            per step, a zero-mean deviation x of the short-window power:
                        a spike (probability P_SPIKE) of depth·U(0.5, 1), else a dip
                        that keeps the mean; depth = TRANSIENT_DEPTH · L · (f/f_ref)·(V/v_ref)²
                        · scale (a fault control, 1 by default)
Calibration: R9700 182 W → ~129 W with −500 MHz/−100 mV (INCIDENTS §2); XTX SCLK max
1500 MHz → ~1233 MHz under load, 2000 MHz/−100 mV → ~1800 MHz (INCIDENTS §3). Transients:
the R9700 at stock shows short-window peaks of 1.3–1.6× its 182 W average (INCIDENTS §2:
peaks 249–289 W per card); with −500 MHz/−100 mV the depth falls to ~55 % of that (dynamic
power goes with f·V²), so the peaks fall further than the average.
What the files show: `power1_average` is the firmware's AverageSocketPower, a short
window that moves with the load's transients (`power_avg_w · (1 + x)`); `power1_input`
(cards that have it) the current socket power, deeper still (`1 + INPUT_GAIN·x`).
`power_avg_w` itself is the long-window mean the power cap regulates (temperatures and
the calibration above use it).
Deterministic: noise comes from per-GPU random.Random(seed)s and only `step(dt)` moves
time.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .cards import CardModel

AMBIENT_C = 30.0
TAU_S = 4.0
P_SPIKE = 0.25          # share of short windows that hold a load step
TRANSIENT_DEPTH = 0.6   # spike depth at full load and the stock operating point
INPUT_GAIN = 1.5        # the current-power sensor sees deeper spikes than the window average


@dataclass
class Sensors:
    """Current sensor values of one GPU, in natural units (rendered by amdgpu.py)."""

    power_avg_w: float = 0.0
    power_input_w: float = 0.0
    temp_edge_c: float = AMBIENT_C
    temp_junction_c: float = AMBIENT_C
    temp_mem_c: float = AMBIENT_C
    sclk_mhz: int = 0
    mclk_mhz: int = 96
    socclk_mhz: int = 0
    fclk_mhz: int = 0
    vddgfx_mv: int = 0
    fan_rpm: int = 0
    busy_pct: int = 0
    pcie_level: int = 0
    transient: float = 0.0      # this step's short-window deviation x (0 = none)

    @property
    def power_window_w(self) -> float:
        """What `power1_average` shows: the short-window average, transients included."""
        return max(0.0, self.power_avg_w * (1.0 + self.transient))


def full_load_clock(model: CardModel, od: dict, od_family: str) -> float:
    p = model.load
    if od_family == "smu14":
        return p.f_ref + od.get("sclk_offset", 0)
    boot_max = model.od_boot.get("sclk_max", model.sclk_max)
    return p.f_ref - p.load_slope * (boot_max - od.get("sclk_max", boot_max))


def voltage(model: CardModel, f: float, offset_mv: int) -> float:
    p = model.load
    return p.v_ref + p.v_per_mhz * (f - p.f_ref) + offset_mv / 1000.0


def power_at(model: CardModel, load: float, f: float, v: float, mclk_share: float) -> float:
    p = model.load
    return p.idle_w + load * (p.mem_w * mclk_share + p.k_dyn * f * v * v)


@dataclass
class Operating:
    """The steady-state operating point for a load level (before noise and thermal lag)."""

    sclk: float
    volts: float
    power: float
    mclk: int


def operating_point(model: CardModel, load: float, od: dict, od_family: str, cap_w: float,
                    perf_level: str = "auto") -> Operating:
    p = model.load
    load = min(max(load, 0.0), 1.0)
    offset = od.get("vddgfx_offset", 0)
    mclk_max = min(model.mclk_levels[-1], od.get("mclk_max", model.mclk_levels[-1]))
    if load <= 0.0 or perf_level == "low":
        f = float(model.sclk_min if perf_level == "low" and load > 0 else p.sclk_idle)
        mclk = model.mclk_levels[0]
        v = p.v_idle
        return Operating(f, v, power_at(model, load, f, max(v, 0.0), 0.0) if load else p.idle_w, mclk)
    f_full = max(float(model.sclk_min), full_load_clock(model, od, od_family))
    f = p.sclk_idle + (f_full - p.sclk_idle) * min(1.0, load / 0.3)
    if perf_level == "high" or perf_level.startswith("profile_peak"):
        f = f_full
    mclk = mclk_max
    share = mclk / model.mclk_levels[-1]
    v = voltage(model, f, offset)
    pw = power_at(model, load, f, v, share)
    if pw > cap_w:
        lo, hi = float(p.sclk_idle), f
        for _ in range(40):   # the SMU lowers the clock until the PPT limit holds
            mid = (lo + hi) / 2
            if power_at(model, load, mid, voltage(model, mid, offset), share) > cap_w:
                hi = mid
            else:
                lo = mid
        f = lo
        v = voltage(model, f, offset)
        pw = power_at(model, load, f, v, share)
    return Operating(f, v, pw, mclk)


class LoadModel:
    """Advances one GPU's sensors by dt seconds."""

    def __init__(self, model: CardModel, seed: int) -> None:
        self.model = model
        self.rng = random.Random(seed)
        self.sensors = Sensors(sclk_mhz=model.load.sclk_idle, mclk_mhz=model.mclk_levels[0],
                               vddgfx_mv=int(model.load.v_idle * 1000))
        self.initialised = False
        # Transients draw from their own generator: the jitter sequence (and every
        # calibration that rests on it) stays what it was.
        self.transient_rng = random.Random(seed * 7919 + 17)
        self.transient_scale = 1.0

    def transient_depth(self, load: float, op: "Operating") -> float:
        p = self.model.load
        if load <= 0 or op.sclk <= 0:
            return 0.0
        return TRANSIENT_DEPTH * min(load, 1.0) * (op.sclk / p.f_ref) * (op.volts / p.v_ref) ** 2 * self.transient_scale

    def step(self, dt: float, load: float, od: dict, od_family: str, cap_w: float,
             perf_level: str, noise: bool = True) -> Sensors:
        m = self.model
        op = operating_point(m, load, od, od_family, cap_w, perf_level)
        jitter = (1.0 + self.rng.uniform(-0.015, 0.015)) if noise and load > 0 else 1.0
        s = self.sensors
        inst = op.power * jitter
        # power1_average: the SMU's ~1 s window; the instantaneous value moves faster.
        a = 1.0 if not self.initialised else 1.0 - math.exp(-dt / 1.0)
        s.power_avg_w = s.power_avg_w + a * (inst - s.power_avg_w)
        depth = self.transient_depth(load, op) if noise else 0.0
        if depth > 0:
            r = self.transient_rng
            spike = r.random() < P_SPIKE
            u = r.uniform(0.5, 1.0)
            # zero mean: E[spike] = P·0.75·depth, the dips between spikes give it back
            s.transient = depth * u if spike else -depth * 0.75 * P_SPIKE / (1 - P_SPIKE)
        else:
            s.transient = 0.0
        s.power_input_w = max(0.0, inst * (1.0 + INPUT_GAIN * s.transient))
        edge_t = AMBIENT_C + m.load.r_edge * s.power_avg_w
        junc_t = edge_t + m.load.r_junction * s.power_avg_w
        mem_t = m.load.mem_base_c + m.load.mem_per_load_c * min(max(load, 0), 1)
        b = 1.0 if not self.initialised else 1.0 - math.exp(-dt / TAU_S)
        if not self.initialised:
            edge_t, junc_t = AMBIENT_C + m.load.r_edge * op.power, AMBIENT_C + (m.load.r_edge + m.load.r_junction) * op.power
        s.temp_edge_c += b * (edge_t - s.temp_edge_c)
        s.temp_junction_c += b * (junc_t - s.temp_junction_c)
        s.temp_mem_c += b * (mem_t - s.temp_mem_c)
        s.sclk_mhz = int(round(op.sclk))
        s.mclk_mhz = op.mclk
        s.vddgfx_mv = int(round(op.volts * 1000))
        s.socclk_mhz = m.socclk_levels[-1] if load > 0 else m.socclk_levels[0]
        s.fclk_mhz = m.fclk_levels[-1] if load > 0 else m.fclk_levels[0]
        busy = load * 100 * (jitter if load < 1 else 1.0)
        s.busy_pct = int(min(100, max(0, round(busy))))
        # Zero-RPM below 50 °C junction, then linear to fan_max at 100 °C.
        if s.temp_junction_c < 50:
            s.fan_rpm = 0
        else:
            frac = min(1.0, (s.temp_junction_c - 50) / 50)
            s.fan_rpm = int(round(600 + frac * (m.fan_max_rpm - 600)))
        s.pcie_level = len(m.pcie_levels) - 1 if load > 0 else 0
        self.initialised = True
        return s
