"""Thermal emergency and power at cap as gpuguard events (issue 21): one event when the
condition starts, one `_cleared` when it ends, no flapping at the line, nothing for a lost card."""
from __future__ import annotations

import time

from gpuguard.policy.gpu_conditions import GpuConditions
from gpuguard.state.hub import HostSnapshot
from gpuguard.state.snapshot import GpuSnapshot


def _gpu(junction: float, power: float, up: bool = True) -> GpuSnapshot:
    return GpuSnapshot(
        name="xtx-0", bdf="0000:aa:00.0", vendor="1002", device_id="744c", driver="amdgpu",
        model="Radeon RX 7900 XTX", card="card2", up=up, time=time.time(), runtime_status="active",
        power_watts=power, power_cap_watts=355.0, power_cap_min_watts=210.0, power_cap_max_watts=355.0,
        power_cap_default_watts=355.0,
        temperatures={"edge": 60.0, "junction": junction},
        temperature_limits={("edge", "emergency"): 105.0, ("junction", "emergency"): 115.0},
    )


def _run(cond: GpuConditions, series: list[tuple[float, float, float]]) -> None:
    for t, junction, power in series:
        cond.observe(HostSnapshot(time=t, gpus=(_gpu(junction, power),)))


def test_thermal_emergency_is_one_event_with_hysteresis():
    got = []
    cond = GpuConditions(got.append)
    # 116 °C over a 115 °C limit (the case), hovering at the line, then cool again.
    _run(cond, [(0, 100, 200), (1, 116, 200), (2, 114, 200), (3, 115, 200), (4, 116, 200), (5, 111, 200), (6, 116, 200)])
    kinds = [(e.kind, e.severity, e.gpu, e.fields.get("sensor")) for e in got]
    assert kinds == [("thermal_emergency", "critical", "xtx-0", "junction"),
                     ("thermal_emergency_cleared", "info", "xtx-0", "junction"),
                     ("thermal_emergency", "critical", "xtx-0", "junction")]
    assert got[0].alert_grade and "116 °C" in got[0].message and "115 °C" in got[0].message


def test_power_at_cap_only_after_a_minute_at_it():
    got = []
    cond = GpuConditions(got.append)
    # 350 W of 355 W (98.6 %): at 30 s no event, at 60 s one; 330 W (93 %) is not yet clear.
    _run(cond, [(0, 80, 350), (30, 80, 350), (59, 80, 350)])
    assert got == []
    _run(cond, [(60, 80, 350), (90, 80, 350), (120, 80, 330), (130, 80, 351)])
    assert [(e.kind, e.severity) for e in got] == [("power_at_cap", "alert")]
    _run(cond, [(140, 80, 200)])
    assert [e.kind for e in got] == ["power_at_cap", "power_at_cap_cleared"]
    # a short burst back at the cap is load, not news
    _run(cond, [(150, 80, 352), (170, 80, 200)])
    assert len(got) == 2


def test_a_lost_card_raises_nothing():
    got = []
    cond = GpuConditions(got.append)
    cond.observe(HostSnapshot(time=0, gpus=(_gpu(120, 360, up=False),)))
    assert got == []


def test_each_condition_start_is_counted_per_gpu_and_kind():
    """gpuguard_gpu_conditions_total: a thermal emergency or a minute at the cap counts even
    where the webhook failed and no Prometheus saw the gauge (a 1 s spike between scrapes)."""
    from prometheus_client import CollectorRegistry

    cond = GpuConditions(lambda e: None)
    reg = CollectorRegistry()
    reg.register(cond)

    def count(kind: str) -> float | None:
        return reg.get_sample_value("gpuguard_gpu_conditions_total", {"gpu": "xtx-0", "kind": kind})

    # every GPU seen starts at 0 for both kinds: the first one is an increase, not a new series
    _run(cond, [(0, 100, 200)])
    assert (count("thermal_emergency"), count("power_at_cap")) == (0.0, 0.0)
    _run(cond, [(1, 116, 200), (2, 114, 200), (3, 116, 200), (4, 100, 200), (5, 116, 200)])
    assert count("thermal_emergency") == 2.0  # hysteresis: the hover at the line is one
    _run(cond, [(10, 80, 350), (70, 80, 350), (80, 80, 200), (90, 80, 350), (151, 80, 350)])
    assert count("power_at_cap") == 2.0
    assert count("thermal_emergency") == 2.0
