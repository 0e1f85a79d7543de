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


def drift(snap: GpuSnapshot, expected: Mapping[str, Any]) -> dict[str, tuple[Any, Any]] | None:
    """setting -> (profile value, value now) for what drifted; None when this snapshot
    cannot tell (GPU down, asleep, OD not read) — absence of data is not drift."""
    if not snap.up or snap.od is None or snap.runtime_status in ("suspended", "suspending"):
        return None
    now = snapshot_values(snap)
    # Only compare what this snapshot actually carries (the cap may be unreadable this cycle).
    known = {k: v for k, v in expected.items() if k in now}
    if not known:
        return None
    return mismatches(known, now)
