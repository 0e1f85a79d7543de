"""Alert-grade conditions read from the GPU poll, as gpuguard events: a sensor at
or over its emergency temperature, and a card held at its power cap. Prometheus alerts on
the same figures; these events reach the webhooks (and `gpuguard events`) even where no
Prometheus is watching, as the notifier's contract says of a thermal emergency.

Debounced like the kernel conditions: one event when a condition starts, one `_cleared`
(info) when it ends, with hysteresis so a value hovering at the line does not flap.
Each start is counted in `gpuguard_gpu_conditions_total{gpu,kind}`, born at 0 for every GPU
seen: a 1 s spike over the emergency line between two scrapes is still an increase that
Prometheus sees, even when the webhook that carried the event failed."""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable

from prometheus_client.core import CounterMetricFamily, Metric

from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot


@dataclass(frozen=True)
class ConditionSettings:
    # INCIDENTS §3: the card throttles hard or shuts down at the emergency line; clear only
    # once it is clearly below it again.
    thermal_clear_below_c: float = 3.0
    # INCIDENTS §2: the cap limits the long-window average; minutes at it mean the card is
    # power-limited, seconds are just load.
    power_at_cap_ratio: float = 0.97
    power_clear_ratio: float = 0.90
    power_hold_seconds: float = 60.0


class GpuConditions:
    """Feed it each poll's HostSnapshot (`observe`); it publishes start/end events."""

    def __init__(self, publish, settings: ConditionSettings = ConditionSettings()) -> None:
        self.publish = publish
        self.settings = settings
        self.hot: set[tuple[str, str]] = set()  # (gpu, sensor) at emergency
        self.at_cap_since: dict[str, float] = {}  # gpu -> first poll at the cap
        self.at_cap: set[str] = set()  # gpus announced at the cap
        self.starts: collections.Counter = collections.Counter()  # (gpu, kind) -> conditions started

    KINDS = ("thermal_emergency", "power_at_cap")

    def observe(self, snap: HostSnapshot) -> None:
        for g in snap.gpus:
            for kind in self.KINDS:
                self.starts.setdefault((g.name, kind), 0)
            if not g.up:
                continue  # a lost card's last figures are not news; gpu_lost says it
            self._thermal(g)
            self._power(g, snap.time)

    def _thermal(self, g) -> None:
        for sensor, temp in sorted(g.temperatures.items()):
            limit = g.temperature_limits.get((sensor, "emergency"))
            if temp is None or limit is None:
                continue
            key = (g.name, sensor)
            if key not in self.hot and temp >= limit:
                self.hot.add(key)
                self.starts[(g.name, "thermal_emergency")] += 1
                self.publish(Event(
                    "thermal_emergency", "critical", "poller",
                    f"GPU {g.name} {sensor} at {temp:.0f} °C, at or over its emergency limit {limit:.0f} °C: "
                    "stop the engine using it, then find the cause (fan, airflow, profile) (INCIDENTS §3)",
                    gpu=g.name, bdf=g.bdf, fields={"sensor": sensor, "celsius": temp, "limit_celsius": limit}))
            elif key in self.hot and temp < limit - self.settings.thermal_clear_below_c:
                self.hot.discard(key)
                self.publish(Event("thermal_emergency_cleared", "info", "poller",
                                   f"GPU {g.name} {sensor} back to {temp:.0f} °C (limit {limit:.0f} °C)",
                                   gpu=g.name, bdf=g.bdf, fields={"sensor": sensor, "celsius": temp}))

    def _power(self, g, now: float) -> None:
        s = self.settings
        if g.power_watts is None or not g.power_cap_watts:
            return
        ratio = g.power_watts / g.power_cap_watts
        if ratio >= s.power_at_cap_ratio:
            since = self.at_cap_since.setdefault(g.name, now)
            if g.name not in self.at_cap and now - since >= s.power_hold_seconds:
                self.at_cap.add(g.name)
                self.starts[(g.name, "power_at_cap")] += 1
                self.publish(Event(
                    "power_at_cap", "alert", "poller",
                    f"GPU {g.name} has drawn {g.power_watts:.0f} W of its {g.power_cap_watts:.0f} W cap for "
                    f"{now - since:.0f} s: clocks are power-limited; a lower SCLK offset and a negative VDDGFX "
                    "offset cut average and peak power where the cap did not (INCIDENTS §2)",
                    gpu=g.name, bdf=g.bdf, fields={"watts": g.power_watts, "cap_watts": g.power_cap_watts}))
        elif ratio < s.power_clear_ratio:
            self.at_cap_since.pop(g.name, None)
            if g.name in self.at_cap:
                self.at_cap.discard(g.name)
                self.publish(Event("power_at_cap_cleared", "info", "poller",
                                   f"GPU {g.name} below its power cap again ({g.power_watts:.0f} W)",
                                   gpu=g.name, bdf=g.bdf, fields={"watts": g.power_watts}))

    def collect(self) -> Iterable[Metric]:
        """The metrics sink's producer (and a prometheus_client collector, for tests)."""
        fam = CounterMetricFamily("gpuguard_gpu_conditions", "Alert-grade GPU conditions started (thermal "
                                  "emergency, a minute at the power cap)", labels=["gpu", "kind"])
        for (gpu, kind), n in sorted(self.starts.items()):
            fam.add_metric([gpu, kind], n)
        yield fam
