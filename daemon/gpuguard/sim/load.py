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
Calibration: R9700 182 W → ~129 W with −500 MHz/−100 mV (INCIDENTS §2); XTX SCLK max
1500 MHz → ~1233 MHz under load, 2000 MHz/−100 mV → ~1800 MHz (INCIDENTS §3).
Deterministic: noise comes from a per-GPU random.Random(seed) and only `step(dt)` moves
time.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .cards import CardModel

AMBIENT_C = 30.0
TAU_S = 4.0


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

    def step(self, dt: float, load: float, od: dict, od_family: str, cap_w: float,
             perf_level: str, noise: bool = True) -> Sensors:
        m = self.model
        op = operating_point(m, load, od, od_family, cap_w, perf_level)
        jitter = (1.0 + self.rng.uniform(-0.015, 0.015)) if noise and load > 0 else 1.0
        s = self.sensors
        inst = op.power * jitter
        # power1_average: the SMU's ~1 s window; the instantaneous value moves faster.
        a = 1.0 if not self.initialised else 1.0 - math.exp(-dt / 1.0)
        s.power_input_w = inst
        s.power_avg_w = s.power_avg_w + a * (inst - s.power_avg_w)
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
