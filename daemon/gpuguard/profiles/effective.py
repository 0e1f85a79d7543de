"""Effective-clock check (INCIDENTS §3): a read-back only echoes what sysfs stored. Under
load, compare the SCLK the card actually runs with what its profile allows, and cards
that share a profile (and model) with each other. The outcome is a finding per card,
shown in status and exported as a metric — never an action."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping

from gpuguard.profiles.schema import Profile
from gpuguard.state.snapshot import GpuSnapshot


@dataclass(frozen=True)
class ClockFinding:
    gpu: str
    profile: str
    kind: str  # above_limit | below_limit | peer_mismatch
    observed_mhz: float
    reference_mhz: float  # the limit, or the peers' median
    message: str


def loaded_sclk_mhz(snap: GpuSnapshot, busy: float) -> float | None:
    if not snap.up or snap.busy_ratio is None or snap.busy_ratio < busy:
        return None
    hz = snap.clocks_hz.get("sclk")
    return None if hz is None else hz / 1e6


def effective_findings(
    gpus: tuple[GpuSnapshot, ...],
    assigned: Mapping[str, tuple[str, Profile]],  # gpu name -> (profile name, profile)
    busy: float = 0.8,
    tolerance: float = 0.15,
) -> tuple[dict[str, float], list[ClockFinding]]:
    """(observed SCLK MHz under load per GPU, findings)."""
    observed: dict[str, float] = {}
    findings: list[ClockFinding] = []
    for g in gpus:
        if g.name not in assigned:
            continue
        mhz = loaded_sclk_mhz(g, busy)
        if mhz is None:
            continue
        observed[g.name] = mhz
        pname, prof = assigned[g.name]
        limit = prof.sclk_max_mhz
        if limit is None:
            continue
        if mhz > limit * (1 + tolerance / 3):
            findings.append(ClockFinding(g.name, pname, "above_limit", mhz, limit,
                f"profile {pname} applied but {g.name} runs at {mhz:.0f} MHz under load, above its "
                f"{limit} MHz limit: the limit is not in effect"))
        elif mhz < limit * (1 - tolerance):
            findings.append(ClockFinding(g.name, pname, "below_limit", mhz, limit,
                f"profile {pname} applied but {g.name} runs at {mhz:.0f} MHz under load "
                f"({limit} MHz allowed): the profile limit holds it back (INCIDENTS §3) or it throttles"))
    # Peers: same profile and same model, both loaded.
    groups: dict[tuple[str, str], list[GpuSnapshot]] = {}
    for g in gpus:
        if g.name in observed:
            groups.setdefault((assigned[g.name][0], g.model), []).append(g)
    for (pname, _model), members in groups.items():
        if len(members) < 2:
            continue
        for m in members:
            mhz = observed[m.name]
            med = statistics.median(observed[o.name] for o in members if o is not m)  # the others
            if med > 0 and abs(mhz - med) / med > tolerance:
                others = ", ".join(f"{o.name} {observed[o.name]:.0f} MHz" for o in members if o is not m)
                findings.append(ClockFinding(m.name, pname, "peer_mismatch", mhz, med,
                    f"profile {pname} applied but {m.name} runs at {mhz:.0f} MHz under load while "
                    f"cards with the same profile run {others}"))
    return observed, findings
