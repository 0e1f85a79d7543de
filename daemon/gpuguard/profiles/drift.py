"""Drift: the OD state the poller read this cycle against what the assigned profile put
on the card. A GPU reset restores stock settings silently (amdgpu-od-protocol §2: the
kernel re-uploads the user table only on resume, not after a reset), so a card that
reverted must be found by comparing, every cycle."""
from __future__ import annotations

from typing import Any, Mapping

from gpuguard.profiles.plan import mismatches, observed_values
from gpuguard.state.snapshot import GpuSnapshot


def snapshot_values(snap: GpuSnapshot) -> dict[str, Any]:
    cap_uw = None if snap.power_cap_watts is None else int(round(snap.power_cap_watts * 1_000_000))
    out: dict[str, Any] = dict(observed_values(snap.od, cap_uw))
    if snap.performance_level is not None:
        out["performance_level"] = snap.performance_level
    return out


# Clock-event reasons that hold a clock below a locked minimum while the lock is still
# set (the H200 ran 1425-1470 MHz under its 700 W cap): the lock did not go, no drift.
HOLDING = frozenset({"sw_power_cap", "hw_slowdown", "hw_thermal", "sw_thermal", "power_brake", "sync_boost"})


def nvidia_drift(snap: GpuSnapshot, expected: Mapping[str, Any]) -> dict[str, tuple[Any, Any]] | None:
    """The same for a card applied through NVML (profiles/nvidia.NvmlPlan.expected): the
    enforced power limit, and the graphics/memory clock against the locked range. A GPU
    reset puts the default limit back and drops the locks, silently, as on amdgpu."""
    if not snap.up:
        return None
    out: dict[str, tuple[Any, Any]] = {}
    if "power_cap_w" in expected and snap.power_cap_watts is not None:
        now = int(round(snap.power_cap_watts))
        if now != expected["power_cap_w"]:
            out["power_cap_w"] = (expected["power_cap_w"], now)
    throttle = ((snap.extra or {}).get("nvml") or {}).get("throttle") or {}
    held = HOLDING & set(throttle.get("active") or ())
    for key, clock in (("sclk_locked_mhz", "sclk"), ("mclk_locked_mhz", "mclk")):
        hz = snap.clocks_hz.get(clock)
        if key not in expected or hz is None:
            continue
        lo, hi = (int(x) for x in str(expected[key]).split("-"))
        mhz = int(round(hz / 1e6))
        if mhz > hi or (mhz < lo and not held):
            out[key] = (expected[key], mhz)
    return out


def drift(snap: GpuSnapshot, expected: Mapping[str, Any]) -> dict[str, tuple[Any, Any]] | None:
    """setting -> (profile value, value now) for what drifted; None when this snapshot
    cannot tell (GPU down, asleep, OD not read) — absence of data is not drift."""
    if snap.driver == "nvidia":
        return nvidia_drift(snap, expected)
    if not snap.up or snap.od is None or snap.runtime_status in ("suspended", "suspending"):
        return None
    now = snapshot_values(snap)
    # Only compare what this snapshot actually carries (the cap may be unreadable this cycle).
    known = {k: v for k, v in expected.items() if k in now}
    if not known:
        return None
    return mismatches(known, now)
