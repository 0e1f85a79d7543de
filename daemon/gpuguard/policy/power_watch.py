"""Power transients in the daemon's life (INCIDENTS §2): keeps one fast sampler per GPU
running (hw/power_sampler.py), and at every poll cycle takes each GPU's interval window,
judges the host against the PSU budget (policy/psu.py), publishes the hub view `power`,
the headroom alert / all-clear events, the metrics, and the flight-recorder rows — with the
raw samples of the seconds before an alert.

The daemon wires it (poller `on_cycle`, a metrics producer, the `power` action provider) and
calls `close()` on the way out; it receives the narrow things it uses, not the daemon.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuguard.hw.power_sampler import PowerChannel, PowerSampler
from gpuguard.hw.power_sources import channel_for
from gpuguard.policy.psu import HostPower, PsuBudget
from gpuguard.state.hub import HostSnapshot, Hub

log = logging.getLogger("gpuguard.power")
VIEW = "power"
# No GPU rests while the host's peaks reach this share of the PSU line (power.psu_watts
# less the margin): there the transients matter however little each card draws.
REST_NEAR_LINE = 0.8


class PowerWatch:
    def __init__(self, hub: Hub, config: Any, channels: Callable[[], Iterable[PowerChannel]],
                 recorder: Any = None, sampler: PowerSampler | None = None,
                 wall: Callable[[], float] = time.time, recorder_cycle: bool = False) -> None:
        self.hub = hub
        self.config = config
        self.channels = channels
        self.recorder = recorder
        # the recorder writes this cycle's rows with its own transaction of the cycle
        # (the daemon records after every other listener): one commit a second
        self.recorder_cycle = recorder_cycle
        self.wall = wall
        self.sampler = sampler or PowerSampler(config.sample_hz, config.burst_seconds, config.cpu_budget_ratio, wall,
                                               rest_after(config))
        self.budget = PsuBudget(config)
        self.last: HostPower | None = None
        # raw samples around an alert: the seconds before it at once, the ones after it
        # as they come, until burst_seconds past the alert
        self._burst_until = float("-inf")
        self._burst_done = float("-inf")  # newest sample time already recorded

    def configure(self, config: Any) -> None:
        """A reloaded `power:` section: budget numbers at once; new sampler settings restart
        the threads at the next cycle."""
        self.config = config
        self.budget.configure(config)
        self.sampler.set_rate(config.sample_hz, config.burst_seconds, config.cpu_budget_ratio, rest_after(config))

    def on_cycle(self, snap: HostSnapshot | None) -> HostPower:
        now = self.wall()
        self.sampler.sync(self.channels() if self.config.sampler else ())
        windows = self.sampler.take_windows()
        snaps = {g.name: g for g in snap.gpus} if snap is not None else {}
        hp, events = self.budget.evaluate(windows, now, snaps)
        self._rest_lines(snaps, hp)
        self.last = hp
        self.hub.set_view(VIEW, hp)
        for e in events:
            self.hub.publish(e)
        self.hub.notes[VIEW] = (f"PSU headroom low: peaks {hp.host_peak_w:.0f} W of a {hp.limit_w:.0f} W line"
                                if hp.alerting and hp.host_peak_w is not None and hp.limit_w is not None else "")
        if self.recorder is not None:
            self._record(hp, [e for e in events if e.kind == "power_headroom_low"])
        return hp

    def _rest_lines(self, snaps: dict, hp: HostPower) -> None:
        """Each GPU's rest line from the cap the poll read this cycle (a profile that
        lowers the cap moves it); no cap known, no line: that GPU never rests. Nor does
        any GPU while the host's peaks are within sight of the PSU line: eight cards
        idling at a fifth of their cap can still be most of a small supply."""
        ratio = self.config.rest_below_ratio
        if hp.limit_w is not None and hp.host_peak_w is not None and hp.host_peak_w >= REST_NEAR_LINE * hp.limit_w:
            ratio = 0.0
        caps = {name: getattr(g, "power_cap_watts", None) for name, g in snaps.items()}
        lines = {name: cap * ratio for name, cap in caps.items() if ratio > 0 and cap} if snaps else self.sampler.rest_lines
        if lines != self.sampler.rest_lines:
            self.sampler.set_rest_lines(lines)

    def _record(self, hp: HostPower, alerts: list) -> None:
        rows: dict[str, list[tuple]] = {
            "power_windows": [(w.end, w.gpu, w.bdf, w.source, w.samples, w.peak_w, w.p99_w, w.mean_w, w.errors)
                              for w in hp.gpus],
            "power_host": [(hp.time, hp.peak_sum_w, hp.mean_sum_w, hp.other_w, hp.psu_w, hp.limit_w, int(hp.alerting))],
        }
        if alerts:
            # the raw samples of the seconds before the alert: what the supply saw
            self._burst_done = hp.time - self.config.burst_seconds
            self._burst_until = hp.time + self.config.burst_seconds
        if self._burst_done < self._burst_until:
            upto = min(hp.time, self._burst_until)
            rows["power_burst"] = [(t, gpu, w, "power_headroom_low") for gpu in sorted(self.sampler.samplers)
                                   for t, w in self.sampler.burst(gpu, self._burst_done) if self._burst_done < t <= upto]
            self._burst_done = upto
        try:
            self.recorder.record_power(rows, cycle=self.recorder_cycle)
        except Exception as e:  # noqa: BLE001 — a recorder problem never stops the power watch
            log.error("recorder: power rows not queued: %s", e)

    def metrics(self) -> Iterable[Metric]:
        hp = self.last
        peak = GaugeMetricFamily("gpuguard_gpu_power_peak_watts",
                                 "Highest fast-sampled power in the last poll interval", labels=["gpu", "source"])
        p99 = GaugeMetricFamily("gpuguard_gpu_power_p99_watts",
                                "99th percentile of fast-sampled power in the last poll interval", labels=["gpu", "source"])
        mean = GaugeMetricFamily("gpuguard_gpu_power_sampled_mean_watts",
                                 "Mean of fast-sampled power in the last poll interval", labels=["gpu", "source"])
        rate = GaugeMetricFamily("gpuguard_power_sampler_hz", "Rate each GPU's power sampler runs at now", labels=["gpu"])
        count = CounterMetricFamily("gpuguard_power_samples", "Fast power samples read", labels=["gpu"])
        errs = CounterMetricFamily("gpuguard_power_sample_errors", "Fast power samples that failed", labels=["gpu"])
        cpu = CounterMetricFamily("gpuguard_power_sampler_cpu_seconds", "CPU time of each GPU's sampler thread",
                                  labels=["gpu"])
        host_peak = GaugeMetricFamily("gpuguard_host_power_peak_watts",
                                      "GPU peaks of the last interval summed, plus power.other_watts")
        host_mean = GaugeMetricFamily("gpuguard_host_power_mean_watts",
                                      "GPU sampled means of the last interval summed, plus power.other_watts")
        psu = GaugeMetricFamily("gpuguard_host_psu_watts", "Configured PSU rating (power.psu_watts)")
        limit = GaugeMetricFamily("gpuguard_host_power_limit_watts", "PSU rating less the margin: the alert line")
        alert = GaugeMetricFamily("gpuguard_host_power_headroom_alert", "1 = GPU peaks plus the rest reach the alert line")
        if hp is not None:
            for w in hp.gpus:
                if w.peak_w is not None:
                    peak.add_metric([w.gpu, w.source], w.peak_w)
                    p99.add_metric([w.gpu, w.source], w.p99_w)
                    mean.add_metric([w.gpu, w.source], w.mean_w)
            if hp.host_peak_w is not None:
                host_peak.add_metric([], hp.host_peak_w)
                host_mean.add_metric([], hp.host_mean_w)
            if hp.psu_w is not None:
                psu.add_metric([], hp.psu_w)
                limit.add_metric([], hp.limit_w)
                alert.add_metric([], 1 if hp.alerting else 0)
        for gpu, s in sorted(self.sampler.samplers.items()):
            rate.add_metric([gpu], s.hz)
            count.add_metric([gpu], s.samples_total)
            errs.add_metric([gpu], s.errors_total)
            cpu.add_metric([gpu], s.cpu_seconds)
        yield from (peak, p99, mean, rate, count, errs, cpu, host_peak, host_mean, psu, limit, alert)

    def document(self) -> dict | None:
        """GET /v1/power: the last interval; None (503) before the first poll cycle."""
        return None if self.last is None else self.last.to_dict()

    def close(self) -> None:
        self.sampler.close()


def rest_after(config: Any) -> float | None:
    """How long every GPU must be at rest before the sampler slows; None: never."""
    return config.rest_after_seconds if config.rest_below_ratio > 0 else None


def poller_channels(poller: Any, hub: Hub) -> Callable[[], list[PowerChannel]]:
    """Channels for the GPUs the poller knows today, lost ones left out, and runtime-
    suspended ones too: the poller does not wake a sleeping card to poll it, and 20 reads a
    second would wake it or keep it from ever sleeping. Rebuilt only when that set changes
    (a channel build stats a file or asks NVML)."""
    cache: dict[str, Any] = {"key": None, "channels": []}

    def channels() -> list[PowerChannel]:
        snap = hub.snapshot
        asleep = {g.bdf for g in (snap.gpus if snap else ()) if g.runtime_status == "suspended"}
        live = {b: sd for b, sd in poller.devices.items()
                if not hub.gpus.is_lost(b) and b not in asleep}
        key = tuple(sorted((b, poller.names.get(b, b), sd[1]) for b, sd in live.items()))
        if key != cache["key"]:
            out = []
            for bdf, (source, dev) in sorted(live.items()):
                try:
                    ch = channel_for(source, dev, poller.names.get(bdf, bdf))
                except Exception as e:  # noqa: BLE001 — one GPU's sensor must not stop the others
                    log.error("power sampler: no channel for %s: %s", bdf, e)
                    ch = None
                if ch is not None:
                    out.append(ch)
            cache["key"], cache["channels"] = key, out
        return cache["channels"]

    return channels
