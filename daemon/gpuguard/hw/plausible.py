"""Plausibility bounds per sensor kind. A reading outside them is not a number to export
or record: it is an unreadable value, with an error naming the file and what it held
(a `temp1_input` holding -99999999999999999999999999 was exported and
recorded as -1e23 °C). The bounds are wide — physics, not policy: they catch garbage,
never a hot card."""
from __future__ import annotations

import math
from typing import Callable

from gpuguard.hw.amdgpu_files import AmdgpuFormatError

Parse = Callable[[bytes, str], float]

# kind -> (lowest, highest, unit) in base units
BOUNDS: dict[str, tuple[float, float, str]] = {
    "temperature": (-60.0, 250.0, "°C"),
    "power": (0.0, 5000.0, "W"),
    "clock": (0.0, 20e9, "Hz"),
    "fan": (0.0, 50000.0, "RPM"),
    "voltage": (0.0, 5.0, "V"),
}


def check(kind: str, value: float, file: str) -> float:
    lo, hi, unit = BOUNDS[kind]
    if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
        raise AmdgpuFormatError(file, f"implausible {kind} {value:g} {unit} (outside {lo:g}..{hi:g} {unit}); "
                                      "treated as unreadable")
    return value


def bounded(parse: Parse, kind: str) -> Parse:
    """`parse`, then the bounds of `kind` (raises AmdgpuFormatError, a ValueError)."""
    if kind not in BOUNDS:
        raise KeyError(f"no plausibility bounds for sensor kind {kind!r}")

    def parse_bounded(data: bytes, file: str) -> float:
        return check(kind, parse(data, file), file)

    parse_bounded.__name__ = f"{getattr(parse, '__name__', 'parse')}_{kind}"
    return parse_bounded


def screen(snap):
    """The same bounds over a whole GpuSnapshot from any source (NVML has no file to
    name): an implausible value is dropped and named in `errors`. A snapshot with nothing
    implausible is returned as is (the amdgpu reader already bounded its files)."""
    import dataclasses

    errors: dict[str, str] = {}
    changes: dict = {}
    where = f"{snap.driver} {snap.bdf}"

    def bad(kind: str, value) -> bool:
        lo, hi, _ = BOUNDS[kind]
        return value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi)

    def say(key: str, kind: str, value) -> None:
        lo, hi, unit = BOUNDS[kind]
        errors[key] = f"{where}: {key}: implausible {kind} {value!r} {unit} (outside {lo:g}..{hi:g} {unit}); treated as unreadable"

    for key in ("power_watts", "power_cap_watts", "power_cap_min_watts", "power_cap_max_watts", "power_cap_default_watts"):
        v = getattr(snap, key)
        if bad("power", v):
            say(key, "power", v)
            changes[key] = None
    if bad("fan", snap.fan_rpm):
        say("fan_rpm", "fan", snap.fan_rpm)
        changes["fan_rpm"] = None
    for field, kind, prefix in (("temperatures", "temperature", "temperature"), ("clocks_hz", "clock", "clock"),
                                ("voltages", "voltage", "voltage")):
        values = getattr(snap, field)
        drop = [k for k, v in values.items() if bad(kind, v)]
        for k in drop:
            say(f"{prefix}_{k}", kind, values[k])
        if drop:
            changes[field] = {k: v for k, v in values.items() if k not in drop}
    if not changes:
        return snap
    return dataclasses.replace(snap, **changes, errors={**snap.errors, **errors})
