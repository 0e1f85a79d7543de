"""Effective-clock check (INCIDENTS §3): a read-back only echoes what sysfs stored. Under
load, compare the SCLK the card actually runs with what the profile on it now allows, and
cards of the same model under comparable load with each other — whatever their profiles:
two identical cards at 1233 and 1802 MHz disagree, and the finding names both and the
likely cause. The outcome is a finding per card, shown in status and exported as a metric
— never an action. Judged against the profile *in effect* (the ledger's last verified
apply, a revert or a reset included), so no finding outlives its cause."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from gpuguard.profiles.schema import Profile
from gpuguard.state.snapshot import GpuSnapshot

COMPARABLE_LOAD = 0.2  # busy ratios this close count as the same load


@dataclass(frozen=True)
class ClockFinding:
    gpu: str
    profile: str  # the profile in effect on `gpu` ("" = none)
    kind: str  # above_limit | below_limit | card_mismatch
    observed_mhz: float
    reference_mhz: float  # the limit, or the faster card's clock
    message: str
    peer: str | None = None  # card_mismatch: the card it disagrees with


def loaded_sclk_mhz(snap: GpuSnapshot, busy: float) -> float | None:
    if not snap.up or snap.busy_ratio is None or snap.busy_ratio < busy:
        return None
    hz = snap.clocks_hz.get("sclk")
    return None if hz is None else hz / 1e6


def _od(g: GpuSnapshot, key: str) -> int | None:
    return g.od.settings.get(key) if g.od is not None else None


def likely_cause(slow: GpuSnapshot, fast: GpuSnapshot, in_effect: Mapping[str, tuple[str, Profile]]) -> str:
    """Why `slow` runs below its twin: a profile or limit on it, else throttling."""
    ps, pf = in_effect.get(slow.name), in_effect.get(fast.name)
    lim_s = ps[1].sclk_max_mhz if ps else None
    lim_f = pf[1].sclk_max_mhz if pf else None
    if lim_s is not None and (lim_f is None or lim_s < lim_f):
        return f"profile {ps[0]} on {slow.name} limits SCLK to {lim_s} MHz"
    off_s = ps[1].sclk_offset_mhz if ps else None
    off_f = pf[1].sclk_offset_mhz if pf else None
    if off_s is not None and off_s < (off_f or 0):
        return f"profile {ps[0]} on {slow.name} lowers SCLK by {-off_s} MHz"
    od_s, od_f = _od(slow, "sclk_max_mhz"), _od(fast, "sclk_max_mhz")
    if od_s is not None and od_f is not None and od_s < od_f:
        return (f"{slow.name}'s OD SCLK maximum reads {od_s} MHz against {od_f} MHz on {fast.name}: a limit set "
                "outside gpuguard (a forgotten clock-limit unit, INCIDENTS §3)")
    off_s, off_f = _od(slow, "sclk_offset_mhz"), _od(fast, "sclk_offset_mhz")
    if off_s is not None and off_f is not None and off_s < off_f:
        return f"{slow.name}'s OD SCLK offset reads {off_s} MHz against {off_f} MHz on {fast.name}"
    cap_s, cap_f = slow.power_cap_watts, fast.power_cap_watts
    if cap_s is not None and cap_f is not None and cap_s < cap_f:
        return f"{slow.name}'s power cap is {cap_s:.0f} W against {cap_f:.0f} W on {fast.name}"
    js, jf = slow.temperatures.get("junction"), fast.temperatures.get("junction")
    temps = f" (junction {js:.0f} vs {jf:.0f} °C)" if js is not None and jf is not None else ""
    return f"no limit differs: thermal or power throttling{temps}, or a different VBIOS"


def effective_findings(
    gpus: tuple[GpuSnapshot, ...],
    in_effect: Mapping[str, tuple[str, Profile]],  # gpu name -> (profile name, profile) on the card now
    busy: float = 0.8,
    tolerance: float = 0.15,
) -> tuple[dict[str, float], list[ClockFinding], frozenset[str]]:
    """(observed SCLK MHz under load per GPU, findings, the GPUs compared with a twin).

    A card is judged against its limit only when observed under load, and against its twins
    only when compared (a twin of the same model observed at comparable load): a card not
    judged this poll has no verdict, which is not the same as agreement."""
    observed: dict[str, float] = {}
    findings: list[ClockFinding] = []
    compared: set[str] = set()
    for g in gpus:
        mhz = loaded_sclk_mhz(g, busy)
        if mhz is None:
            continue
        observed[g.name] = mhz
        if g.name not in in_effect:
            continue
        pname, prof = in_effect[g.name]
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
    # Card against card: same model (PCI id), comparable load, whatever the profiles.
    groups: dict[tuple[str, str], list[GpuSnapshot]] = {}
    for g in gpus:
        if g.name in observed:
            groups.setdefault((g.vendor, g.device_id), []).append(g)
    for members in groups.values():
        if len(members) < 2:
            continue
        for slow in members:
            mhz = observed[slow.name]
            peers = [o for o in members if o is not slow and abs((o.busy_ratio or 0) - (slow.busy_ratio or 0)) <= COMPARABLE_LOAD]
            if not peers:
                continue
            compared.add(slow.name)
            fast = max(peers, key=lambda o: observed[o.name])
            ref = observed[fast.name]
            if ref <= 0 or (ref - mhz) / ref <= tolerance:
                continue
            pname = in_effect[slow.name][0] if slow.name in in_effect else ""
            findings.append(ClockFinding(slow.name, pname, "card_mismatch", mhz, ref,
                f"{slow.name} and {fast.name} ({slow.model}) disagree: {slow.name} runs {mhz:.0f} MHz under "
                f"load, {fast.name} {ref:.0f} MHz at comparable load; likely cause: {likely_cause(slow, fast, in_effect)}",
                peer=fast.name))
    return observed, findings, frozenset(compared)
