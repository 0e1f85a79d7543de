"""Prometheus export. A custom collector formats the hub's latest snapshot: a scrape never
touches sysfs (prometheus/client_python runs collect() on the serving thread/loop).

Names follow reference/METRICS.md: prefix `gpuguard_`, base units, `gpu` = configured
name, `bdf` = PCI address. Other sources add families through `producers`.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuguard import __version__
from gpuguard.sinks.nvml_metrics import nvml_families
from gpuguard.state.hub import Hub

Producer = Callable[[], Iterable[Metric]]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class HubCollector(Collector):
    def __init__(self, hub: Hub, producers: Iterable[Producer] = ()) -> None:
        self.hub = hub
        self.producers = list(producers)

    def describe(self) -> list:
        # Returning nothing keeps registration from calling collect() early.
        return []

    def collect(self) -> Iterable[Metric]:
        build = _g("gpuguard_build_info", "gpuguard build", ["version"])
        build.add_metric([__version__], 1)
        yield build
        yield from self._gpu_families()
        yield from nvml_families(self.hub.snapshot)  # NVIDIA health through NVML (issue 18)
        errors = CounterMetricFamily(
            "gpuguard_poll_errors", "Values that could not be read, per GPU and source", labels=["gpu", "source"]
        )
        for (gpu, source), n in sorted(self.hub.counters.poll_errors.items()):
            errors.add_metric([gpu, source], n)
        yield errors
        yield from self.hub.counters.poll_duration.collect()
        last = _g("gpuguard_last_poll_timestamp_seconds", "Wall time of the last finished poll", ["source"])
        for source, t in sorted(self.hub.last_poll.items()):
            last.add_metric([source], t)
        yield last
        kev = CounterMetricFamily("gpuguard_kernel_events", "Classified kernel log lines", labels=["gpu", "kind"])
        # GPU-less lines (OOM kill, hung task) count under gpu="host" (state/gpus.py)
        for (gpu, kind), n in sorted(self.hub.gpus.kernel_counts.items()):
            kev.add_metric([gpu, kind], n)
        yield kev
        missing = _g("gpuguard_gpu_configured_missing", "1 = a configured GPU has no identified present card",
                     ["gpu", "match"])
        for m in self.hub.gpus.missing():
            missing.add_metric([m.name, m.match], 1)
        yield missing
        for produce in self.producers:
            yield from produce()

    def _gpu_families(self) -> Iterable[Metric]:
        snap = self.hub.snapshot
        gpus = snap.gpus if snap else ()
        info = _g("gpuguard_gpu_info", "GPU identity; card is today's cardN", ["gpu", "bdf", "vendor", "device_id", "model", "card", "driver"])
        up = _g("gpuguard_gpu_up", "1 = GPU answering, 0 = lost or not answering", ["gpu"])
        suspended = _g("gpuguard_gpu_runtime_suspended", "1 = runtime-suspended (not woken to poll)", ["gpu"])
        power = _g("gpuguard_gpu_power_watts", "Average package power", ["gpu"])
        cap = _g("gpuguard_gpu_power_cap_watts", "Current power cap", ["gpu"])
        cap_min = _g("gpuguard_gpu_power_cap_min_watts", "Lowest settable power cap", ["gpu"])
        cap_max = _g("gpuguard_gpu_power_cap_max_watts", "Highest settable power cap", ["gpu"])
        cap_def = _g("gpuguard_gpu_power_cap_default_watts", "Default power cap", ["gpu"])
        temp = _g("gpuguard_gpu_temperature_celsius", "Temperature per sensor", ["gpu", "sensor"])
        tlim = _g("gpuguard_gpu_temperature_limit_celsius", "Temperature limits per sensor", ["gpu", "sensor", "level"])
        clock = _g("gpuguard_gpu_clock_hertz", "Current clock", ["gpu", "domain"])
        fan = _g("gpuguard_gpu_fan_rpm", "Fan speed", ["gpu"])
        busy = _g("gpuguard_gpu_busy_ratio", "GPU busy, 0-1", ["gpu"])
        vused = _g("gpuguard_gpu_vram_used_bytes", "VRAM in use", ["gpu"])
        vtotal = _g("gpuguard_gpu_vram_total_bytes", "VRAM size", ["gpu"])
        vvis = _g("gpuguard_gpu_vram_visible_bytes", "CPU-visible VRAM (equals total with large BAR)", ["gpu"])
        vres = _g("gpuguard_gpu_vram_reserved_bytes", "VRAM the NVIDIA driver reserves (not in used; NVML v2)", ["gpu"])
        volt = _g("gpuguard_gpu_voltage_volts", "Voltage per rail", ["gpu", "rail"])
        od = _g("gpuguard_gpu_od_setting", "OD setting read back now", ["gpu", "setting"])
        for g in gpus:
            info.add_metric([g.name, g.bdf, g.vendor, g.device_id, g.model, g.card or "", g.driver], 1)
            up.add_metric([g.name], 1 if g.up else 0)
            suspended.add_metric([g.name], 1 if g.runtime_status == "suspended" else 0)
            for fam, value in (
                (power, g.power_watts),
                (cap, g.power_cap_watts),
                (cap_min, g.power_cap_min_watts),
                (cap_max, g.power_cap_max_watts),
                (cap_def, g.power_cap_default_watts),
                (fan, g.fan_rpm),
                (busy, g.busy_ratio),
                (vused, g.vram_used_bytes),
                (vtotal, g.vram_total_bytes),
                (vvis, g.vram_visible_bytes),
                (vres, g.vram_reserved_bytes),
            ):
                if value is not None:  # unknown is absent, never a zero
                    fam.add_metric([g.name], value)
            for sensor, v in sorted(g.temperatures.items()):
                temp.add_metric([g.name, sensor], v)
            for (sensor, level), v in sorted(g.temperature_limits.items()):
                tlim.add_metric([g.name, sensor, level], v)
            for domain, v in sorted(g.clocks_hz.items()):
                clock.add_metric([g.name, domain], v)
            for rail, v in sorted(g.voltages.items()):
                volt.add_metric([g.name, rail], v)
            if g.od is not None:
                for setting, v in sorted(g.od.settings.items()):
                    od.add_metric([g.name, setting], v)
        yield from (info, up, suspended, power, cap, cap_min, cap_max, cap_def, temp, tlim, clock, fan, busy, vused, vtotal, vvis, vres, volt, od)


class MetricsSink:
    """Owns the registry; `render()` returns the exposition text."""

    def __init__(self, hub: Hub, producers: Iterable[Producer] = ()) -> None:
        self.collector = HubCollector(hub, producers)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    def add_producer(self, produce: Producer) -> None:
        self.collector.producers.append(produce)

    def render(self) -> bytes:
        return generate_latest(self.registry)
