"""The load model: deterministic, calibrated to the incident numbers, monotonic in the
settings the daemon changes."""
from __future__ import annotations

import pytest

from gpuguard.sim.host import SimHost

R9700 = "0000:05:00.0"
XTX = "0000:aa:00.0"


def settle(h: SimHost, bdf: str, level: float = 1.0, seconds: float = 30.0):
    h.set_load(bdf, level)
    for _ in range(int(seconds / 0.5)):
        h.step(0.5)
    return h.gpu(bdf).sensors


def apply(h: SimHost, bdf: str, *cmds: bytes) -> None:
    for c in cmds:
        h.write(f"{h.device_path(bdf)}/pp_od_clk_voltage", c)


def test_r9700_incident_numbers():
    """INCIDENTS §2: 182 → 129 W average with -500 MHz / -100 mV."""
    stock = settle(SimHost.incident(seed=1), R9700)
    assert stock.power_avg_w == pytest.approx(182, abs=5)
    h = SimHost.incident(seed=1)
    apply(h, R9700, b"s -500", b"vo -100", b"c")
    limited = settle(h, R9700)
    assert limited.power_avg_w == pytest.approx(129, abs=5)
    assert limited.sclk_mhz < stock.sclk_mhz - 400
    assert limited.vddgfx_mv < stock.vddgfx_mv - 100


def test_xtx_clock_cap_runs_at_1233():
    """INCIDENTS §3: SCLK max 1500 MHz → ~1233 MHz under load; stock runs ~2371 under the cap."""
    h = SimHost.incident(seed=2)
    apply(h, XTX, b"s 1 1500", b"c")
    assert settle(h, XTX).sclk_mhz == pytest.approx(1233, abs=10)
    h2 = SimHost.incident(seed=2)
    apply(h2, XTX, b"s 1 2000", b"vo -100", b"c")
    assert 1750 < settle(h2, XTX).sclk_mhz < 1850


def test_lower_settings_lower_power_and_clock():
    results = []
    for offset in (0, -200, -400):
        h = SimHost.incident(seed=3)
        apply(h, R9700, f"s {offset}".encode(), b"c")
        s = settle(h, R9700)
        results.append((s.power_avg_w, s.sclk_mhz))
    assert results[0] > results[1] > results[2]
    powers = []
    for vo in (0, -50, -150):
        h = SimHost.incident(seed=3)
        apply(h, R9700, f"vo {vo}".encode(), b"c")
        powers.append(settle(h, R9700).power_avg_w)
    assert powers[0] > powers[1] > powers[2]


def test_power_cap_limits_average_power():
    h = SimHost.incident(seed=4)
    stock = settle(h, XTX).power_avg_w
    h2 = SimHost.incident(seed=4)
    h2.write(f"{h2.hwmon_path(XTX)}/power1_cap", b"320000000")
    capped = settle(h2, XTX)
    assert capped.power_avg_w <= 320 * 1.02 < stock
    assert capped.sclk_mhz < h.gpu(XTX).sensors.sclk_mhz


def test_staged_but_uncommitted_od_does_not_change_the_card():
    h = SimHost.incident(seed=5)
    apply(h, R9700, b"s -500")
    assert settle(h, R9700).power_avg_w == pytest.approx(182, abs=5)


def test_deterministic_given_seed():
    def run(seed):
        h = SimHost.incident(seed=seed)
        trace = []
        h.set_load(R9700, 0.7)
        for _ in range(10):
            h.step(0.5)
            trace.append((h.gpu(R9700).sensors.power_input_w,
                          h.read(f"{h.hwmon_path(R9700)}/power1_average"),
                          h.read(f"{h.device_path(R9700)}/gpu_busy_percent")))
        return trace
    assert run(11) == run(11)
    assert run(11) != run(12)


def test_idle_to_load_heats_and_spins_fan():
    h = SimHost.incident(seed=6)
    idle = settle(h, XTX, 0.0, 5)
    assert idle.fan_rpm == 0 and idle.busy_pct == 0
    t_idle = idle.temp_junction_c
    s = settle(h, XTX, 1.0, 30)
    assert s.temp_junction_c > t_idle + 20 and s.fan_rpm > 600 and s.busy_pct == 100
    hw = h.hwmon_path(XTX)
    assert int(h.read(f"{hw}/temp2_input")) == round(s.temp_junction_c) * 1000
    assert int(h.read(f"{hw}/freq1_input")) == s.sclk_mhz * 1_000_000
    assert b"*" in h.read(f"{h.device_path(XTX)}/pp_dpm_sclk")


def test_gpu_reset_reverts_the_effect():
    h = SimHost.incident(seed=8)
    apply(h, R9700, b"s -500", b"vo -100", b"c")
    limited = settle(h, R9700).power_avg_w
    h.reset_gpu(R9700)
    assert settle(h, R9700).power_avg_w > limited + 40
