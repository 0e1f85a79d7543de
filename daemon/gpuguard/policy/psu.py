"""The host PSU budget: the GPUs' per-interval power peaks plus the rest of the host,
against the supply (INCIDENTS §2: two R9700 tripped a 1300 W supply at an average of
263 W each — the averages looked safe, the transients were not).

Owns: `HostPower` (one interval's verdict), the headroom alert with its hysteresis
(raised when peaks + `other_watts` reach `psu_watts · (1 - margin_ratio)`, cleared only
after `clear_after_seconds` in a row at least `clear_margin_ratio · psu_watts` under that
line, whatever the poll interval: one condition, one alert, however the peaks wander around
the line) and the advice: which cap or clock /
voltage offsets would restore the margin, from the observed peak-to-average ratio. Pure
logic over sampler windows and the poll snapshot; writes nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from gpuguard.hw.power_sampler import PowerWindow
from gpuguard.state.events import Event

# Aim the advice this far below the alert line, so one good interval is not the target.
ADVICE_TARGET_RATIO = 0.9
# INCIDENTS §2: -100 mV was the undervolt that held; never advise a deeper one unasked.
ADVISED_UNDERVOLT_MV = -100
NOMINAL_VOLTS = 1.0  # when the card reports no vddgfx


@dataclass(frozen=True)
class GpuAdvice:
    gpu: str
    peak_w: float
    mean_w: float
    allowed_peak_w: float
    cap_needed_w: float | None  # the cap that would hold the peak at the observed ratio
    cap_min_w: float | None
    vddgfx_offset_mv: int | None
    sclk_offset_mhz: int | None  # RDNA4-style cards
    sclk_max_mhz: int | None  # RDNA1-3-style cards
    text: str

    def profile(self) -> dict[str, int]:
        out = {}
        for k in ("sclk_offset_mhz", "sclk_max_mhz", "vddgfx_offset_mv"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu, "peak_watts": self.peak_w, "mean_watts": self.mean_w,
            "allowed_peak_watts": self.allowed_peak_w, "cap_needed_watts": self.cap_needed_w,
            "cap_min_watts": self.cap_min_w, "profile": self.profile(), "text": self.text,
        }


@dataclass(frozen=True)
class HostPower:
    """One poll interval of the whole host. Sums cover the GPUs that had samples."""

    time: float
    gpus: tuple[PowerWindow, ...]
    peak_sum_w: float | None
    mean_sum_w: float | None
    other_w: float
    psu_w: float | None
    limit_w: float | None  # psu · (1 - margin): the alert line
    over: bool
    alerting: bool
    advice: tuple[GpuAdvice, ...] = field(default=())

    @property
    def host_peak_w(self) -> float | None:
        return None if self.peak_sum_w is None else self.peak_sum_w + self.other_w

    @property
    def host_mean_w(self) -> float | None:
        return None if self.mean_sum_w is None else self.mean_sum_w + self.other_w

    @property
    def headroom_w(self) -> float | None:
        if self.psu_w is None or self.host_peak_w is None:
            return None
        return self.psu_w - self.host_peak_w

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time, "gpus": [w.to_dict() for w in self.gpus], "gpu_peak_sum_watts": self.peak_sum_w,
            "gpu_mean_sum_watts": self.mean_sum_w, "other_watts": self.other_w, "host_peak_watts": self.host_peak_w,
            "host_mean_watts": self.host_mean_w, "psu_watts": self.psu_w, "limit_watts": self.limit_w,
            "headroom_watts": self.headroom_w, "over": self.over, "alerting": self.alerting,
            "advice": [a.to_dict() for a in self.advice],
        }


def _round_down(v: float, step: int) -> int:
    return int(math.floor(v / step) * step)


def advise_gpu(w: PowerWindow, allowed_peak_w: float, gpu_snap: Any = None) -> GpuAdvice | None:
    """What would bring this GPU's peak down to `allowed_peak_w`. The cap regulates the
    long-window average, so a cap only helps at the observed peak-to-average ratio, and
    not below the card's floor (INCIDENTS §2: 280 → 210 W did not stop the trips). Clock
    and voltage offsets cut the dynamic power — and its transients — which goes with f·V²."""
    if w.peak_w is None or not w.mean_w or w.peak_w <= allowed_peak_w:
        return None
    ratio = w.peak_w / w.mean_w
    k = allowed_peak_w / w.peak_w
    cap_needed = allowed_peak_w / ratio
    cap_min = getattr(gpu_snap, "power_cap_min_watts", None)
    volts = (getattr(gpu_snap, "voltages", None) or {}).get("vddgfx") or NOMINAL_VOLTS
    sclk_hz = (getattr(gpu_snap, "clocks_hz", None) or {}).get("sclk")
    od = getattr(gpu_snap, "od", None)
    settings = dict(od.settings) if od is not None else {}
    ranges = dict(od.ranges) if od is not None else {}
    vo = None
    q = 1.0
    if od is None or "vddgfx_offset_mv" in settings:
        lo = ranges["vddgfx_offset_mv"].min if "vddgfx_offset_mv" in ranges else ADVISED_UNDERVOLT_MV
        vo = max(ADVISED_UNDERVOLT_MV, lo)
        q = ((volts + vo / 1000.0) / volts) ** 2 if vo else 1.0
    f_ratio = min(1.0, k / q)  # what is left for the clock after the undervolt
    sclk_offset = sclk_max = None
    if f_ratio < 1.0 and sclk_hz:
        f = sclk_hz / 1e6
        if "sclk_max_mhz" in settings:
            sclk_max = _round_down(f * f_ratio, 50)
            if "sclk_max_mhz" in ranges:
                sclk_max = max(sclk_max, ranges["sclk_max_mhz"].min)
        else:
            sclk_offset = _round_down(f * (f_ratio - 1.0), 50)
            if "sclk_offset_mhz" in ranges:
                sclk_offset = max(sclk_offset, ranges["sclk_offset_mhz"].min)
    parts = []
    if sclk_offset:
        parts.append(f"sclk_offset_mhz: {sclk_offset}")
    if sclk_max is not None:
        parts.append(f"sclk_max_mhz: {sclk_max}")
    if vo:
        parts.append(f"vddgfx_offset_mv: {vo}")
    floor = f" (the card's floor is {cap_min:g} W)" if cap_min is not None else ""
    if cap_min is not None and cap_needed < cap_min:
        cap_text = f"a power cap alone cannot do it: it would need {cap_needed:.0f} W{floor}"
    else:
        cap_text = (f"a cap of {cap_needed:.0f} W would hold the average there{floor}, but the cap acts on "
                    "the long-window average, not on the transients (INCIDENTS §2)")
    text = (f"{w.gpu}: peaks {w.peak_w:.0f} W at {ratio:.2f}× its {w.mean_w:.0f} W average; to keep the peak "
            f"under {allowed_peak_w:.0f} W {cap_text}; lower clock and voltage instead: profile "
            f"{{{', '.join(parts) or 'no OD offsets on this card: lower the load or split it in time'}}}")
    return GpuAdvice(w.gpu, w.peak_w, w.mean_w, allowed_peak_w, cap_needed, cap_min, vo, sclk_offset, sclk_max, text)


def advise(windows: Iterable[PowerWindow], limit_w: float, other_w: float,
           snaps: Mapping[str, Any] | None = None) -> tuple[GpuAdvice, ...]:
    """Per-GPU advice that brings the summed peaks to ADVICE_TARGET_RATIO of the line,
    each GPU's share of the GPU budget in proportion to its observed peak."""
    ws = [w for w in windows if w.peak_w is not None]
    peak_sum = sum(w.peak_w for w in ws)  # type: ignore[misc]
    budget = limit_w * ADVICE_TARGET_RATIO - other_w
    if not ws or peak_sum <= 0 or budget <= 0:  # other_watts alone fills the line: no GPU setting helps
        return ()
    out = []
    for w in ws:
        allowed = max(0.0, budget) * w.peak_w / peak_sum  # type: ignore[operator]
        a = advise_gpu(w, allowed, (snaps or {}).get(w.gpu))
        if a is not None:
            out.append(a)
    return tuple(out)


class PsuBudget:
    """Evaluates each interval's windows; keeps the alert state between intervals."""

    def __init__(self, config: Any) -> None:
        self.configure(config)
        self.alerting = False
        self._below_since: float | None = None  # start of the intervals in a row under the clear line

    def configure(self, config: Any) -> None:
        if config.psu_watts is None:  # budget switched off by a reload: no alert can hold
            self.alerting, self._below_since = False, None
        self.psu_w = config.psu_watts
        self.other_w = config.other_watts
        self.margin = config.margin_ratio
        self.clear_margin = config.clear_margin_ratio
        self.clear_after_s = config.clear_after_seconds

    @property
    def clear_w(self) -> float | None:
        """The line the peaks must stay under for the alert to clear."""
        return None if self.psu_w is None else self.psu_w * (1.0 - self.margin - self.clear_margin)

    @property
    def limit_w(self) -> float | None:
        return None if self.psu_w is None else self.psu_w * (1.0 - self.margin)

    def evaluate(self, windows: Mapping[str, PowerWindow], now: float,
                 snaps: Mapping[str, Any] | None = None) -> tuple[HostPower, list[Event]]:
        ws = tuple(sorted(windows.values(), key=lambda w: w.gpu))
        sampled = [w for w in ws if w.peak_w is not None]
        peak_sum = sum(w.peak_w for w in sampled) if sampled else None  # type: ignore[misc]
        mean_sum = sum(w.mean_w for w in sampled) if sampled else None  # type: ignore[misc]
        limit = self.limit_w
        events: list[Event] = []
        over = limit is not None and peak_sum is not None and peak_sum + self.other_w >= limit
        advice: tuple[GpuAdvice, ...] = ()
        if limit is not None and peak_sum is not None:
            if over:
                self._below_since = None
                advice = advise(sampled, limit, self.other_w, snaps)
                if not self.alerting:
                    self.alerting = True
                    events.append(self._alert(peak_sum, mean_sum, limit, sampled, advice, now))
            elif self.alerting:
                # between the clear line and the alert line: still the same condition. The time
                # under the clear line runs from the start of the first such interval's windows.
                if peak_sum + self.other_w >= self.clear_w:
                    self._below_since = None
                elif self._below_since is None:
                    self._below_since = min(w.start for w in sampled)
                below_s = 0.0 if self._below_since is None else now - self._below_since
                if below_s >= self.clear_after_s - 1e-6:  # float sums of interval lengths
                    self._below_since = None
                    self.alerting = False
                    events.append(Event(
                        "power_headroom_ok", "info", "power",
                        f"PSU headroom back: GPU peaks {peak_sum:.0f} W + other {self.other_w:.0f} W = "
                        f"{peak_sum + self.other_w:.0f} W, under {self.clear_w:.0f} W ({limit:.0f} W line less "
                        f"{self.clear_margin:.0%} of the supply) for {below_s:.1f} s in a row",
                        time=now,
                        fields={"host_peak_watts": peak_sum + self.other_w, "limit_watts": limit, "psu_watts": self.psu_w},
                    ))
        hp = HostPower(now, ws, peak_sum, mean_sum, self.other_w, self.psu_w, limit, over, self.alerting, advice)
        return hp, events

    def _alert(self, peak_sum: float, mean_sum: float | None, limit: float, sampled: list[PowerWindow],
               advice: tuple[GpuAdvice, ...], now: float) -> Event:
        per_gpu = ", ".join(f"{w.gpu} peak {w.peak_w:.0f} W / mean {w.mean_w:.0f} W ({w.source})" for w in sampled)
        host_mean = (mean_sum or 0.0) + self.other_w
        msg = (f"PSU headroom low: GPU peaks {peak_sum:.0f} W + other {self.other_w:.0f} W = "
               f"{peak_sum + self.other_w:.0f} W reach the {limit:.0f} W line of a {self.psu_w:.0f} W supply "
               f"(margin {self.margin:.0%}) while the averages sum to {host_mean:.0f} W [{per_gpu}]. "
               "A cap governs the average, not these peaks (INCIDENTS §2). "
               + " ".join(a.text for a in advice))
        return Event(
            "power_headroom_low", "alert", "power", msg, time=now,
            fields={
                "host_peak_watts": peak_sum + self.other_w, "host_mean_watts": host_mean, "limit_watts": limit,
                "psu_watts": self.psu_w, "other_watts": self.other_w,
                "gpus": {w.gpu: {"peak_watts": w.peak_w, "p99_watts": w.p99_w, "mean_watts": w.mean_w,
                                 "source": w.source} for w in sampled},
                "advice": [a.to_dict() for a in advice],
            },
        )
