"""Immutable snapshots: the poller makes them, everyone else reads them.

A value that could not be read is absent (None) and its reason is in `errors`
(`{"power_watts": "read .../power1_average: EIO (Input/output error)"}`): never a zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


def _frozen(m: Mapping | None) -> Mapping:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True)
class OdRange:
    """One `OD_RANGE` line: the card's own allowed interval for a setting."""

    min: int
    max: int


@dataclass(frozen=True)
class OdState:
    """The parsed `pp_od_clk_voltage` of one card.

    `format` names the layout the card printed (`rdna3`, `rdna4`, `rdna4-limits`,
    `navi1x-curve`, `rdna3-curve`, `navi2x`, `vega10-table`, `smu7-table`, `apu`,
    `empty`, ...); the apply path picks its write syntax from it, never from the PCI id.
    `settings` are current values keyed by setting name (`sclk_min_mhz`,
    `sclk_max_mhz`, `mclk_max_mhz`, `sclk_offset_mhz`, `vddgfx_offset_mv`, ...);
    `ranges` the card's OD_RANGE per setting name; `tables` keeps per-level tables
    (`sclk_levels`: ((mhz, mv), ...)) for older generations.
    """

    format: str
    settings: Mapping[str, int] = field(default_factory=dict)
    ranges: Mapping[str, OdRange] = field(default_factory=dict)
    tables: Mapping[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", _frozen(self.settings))
        object.__setattr__(self, "ranges", _frozen(self.ranges))
        object.__setattr__(self, "tables", _frozen(self.tables))

    def levels(self) -> dict[str, list[dict[str, int]]]:
        """Per-level clock/voltage tables of the older generations (SMU7/Polaris,
        Vega10: `OD_SCLK: 0: 300MHz 750mV …`), {"sclk": [{"level", "mhz", "mv"}, …]}."""
        out = {}
        for clk in ("sclk", "mclk"):
            rows = self.tables.get(f"{clk}_levels")
            if rows:
                out[clk] = [{"level": i, "mhz": mhz, "mv": mv} for i, (mhz, mv) in enumerate(rows)]
        return out

    def top_level(self, clk: str) -> tuple[int, int] | None:
        """(MHz, mV) of the highest `clk` level of a per-level table, None without one."""
        rows = self.tables.get(f"{clk}_levels")
        return tuple(rows[-1]) if rows else None


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU at one instant. Units are base units: watts, celsius, hertz, bytes, volts."""

    name: str  # configured name (default: the PCI address, state/identity.default_name)
    bdf: str  # 0000:05:00.0
    vendor: str  # hex, "1002"
    device_id: str  # hex, "7551"
    driver: str  # amdgpu, nvidia
    model: str  # human model name ("Radeon AI PRO R9700")
    card: str | None  # today's drm cardN (never used as identity, INCIDENTS §8)
    up: bool  # False = lost or not answering
    time: float  # wall clock of the read
    runtime_status: str | None = None  # power/runtime_status: active/suspended/...
    power_watts: float | None = None
    power_cap_watts: float | None = None
    power_cap_min_watts: float | None = None
    power_cap_max_watts: float | None = None
    power_cap_default_watts: float | None = None
    temperatures: Mapping[str, float] = field(default_factory=dict)  # edge/junction/mem
    temperature_limits: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (sensor, crit|emergency)
    clocks_hz: Mapping[str, float] = field(default_factory=dict)  # sclk/mclk
    fan_rpm: float | None = None
    busy_ratio: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    vram_visible_bytes: int | None = None
    vram_reserved_bytes: int | None = None  # NVIDIA: driver/firmware reserve, not in `used` (NVML v2)
    voltages: Mapping[str, float] = field(default_factory=dict)  # rail -> volts
    performance_level: str | None = None
    od: OdState | None = None
    od_error: str | None = None  # why `od` is absent (no file: OD disabled, parse error, ...)
    errors: Mapping[str, str] = field(default_factory=dict)  # value name -> reason
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("temperatures", "temperature_limits", "clocks_hz", "voltages", "errors", "extra"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "bdf": self.bdf,
            "vendor": self.vendor,
            "device_id": self.device_id,
            "driver": self.driver,
            "model": self.model,
            "card": self.card,
            "up": self.up,
            "time": self.time,
            "runtime_status": self.runtime_status,
            "power_watts": self.power_watts,
            "power_cap_watts": self.power_cap_watts,
            "power_cap_min_watts": self.power_cap_min_watts,
            "power_cap_max_watts": self.power_cap_max_watts,
            "power_cap_default_watts": self.power_cap_default_watts,
            "temperatures_celsius": dict(self.temperatures),
            "temperature_limits_celsius": {f"{s}/{lvl}": v for (s, lvl), v in self.temperature_limits.items()},
            "clocks_hz": dict(self.clocks_hz),
            "fan_rpm": self.fan_rpm,
            "busy_ratio": self.busy_ratio,
            "vram_used_bytes": self.vram_used_bytes,
            "vram_total_bytes": self.vram_total_bytes,
            "vram_visible_bytes": self.vram_visible_bytes,
            "vram_reserved_bytes": self.vram_reserved_bytes,
            "voltages_volts": dict(self.voltages),
            "performance_level": self.performance_level,
            "od": None
            if self.od is None
            else {
                "format": self.od.format,
                "settings": dict(self.od.settings),
                "ranges": {k: [r.min, r.max] for k, r in self.od.ranges.items()},
                "levels": self.od.levels(),
            },
            "od_error": self.od_error,
            "errors": dict(self.errors),
        }
        if self.extra:
            d["extra"] = dict(self.extra)
        return d
