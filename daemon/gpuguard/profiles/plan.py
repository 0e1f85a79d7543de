"""Planning an apply: (profile, the card's `OdState`, its power-cap limits) → an ordered
list of writes plus the values a read-back must show, or a refusal before anything is
written.

Owns validation (card OD_RANGE, power1_cap_min…max, the profile envelope, no positive
voltage offset unless `allow_overvolt`), the write syntax per `OdState.format` (what the
card's own file printed, never the PCI id — amdgpu-od-protocol §2/§6) and the ordering
rules per generation:
- Navi1x/Navi2x check `s 0`/`s 1` against the other bound already staged: raise max
  before raising min, lower min before lowering max (protocol §2).
- Navi1x `r` only restores the staging table: it needs `c` (protocol §2).
- RDNA3: the power cap written after the OD commit is what the card enforces (LACT #430,
  #506; protocol §4) — so every generation writes `power1_cap` after `c`.
Never plans a `pp_dpm_*` write: on these cards that is silently ignored (INCIDENTS §2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from gpuguard.profiles.schema import OD_SETTINGS, Profile
from gpuguard.state.snapshot import OdState

OD_FILE = "pp_od_clk_voltage"
CAP_FILE = "power1_cap"
LEVEL_FILE = "power_dpm_force_performance_level"

# Which profile settings each layout can take (keys of amdgpu_od's OdState.settings).
SUPPORTED: Mapping[str, frozenset[str]] = {
    "rdna4": frozenset({"sclk_offset_mhz", "mclk_max_mhz", "vddgfx_offset_mv"}),
    "rdna4-limits": frozenset({"sclk_offset_mhz", "mclk_max_mhz", "vddgfx_offset_mv"}),
    "rdna3": frozenset({"sclk_min_mhz", "sclk_max_mhz", "mclk_max_mhz", "vddgfx_offset_mv"}),
    "rdna3-curve": frozenset({"sclk_min_mhz", "sclk_max_mhz", "mclk_max_mhz", "vddgfx_offset_mv"}),
    "navi2x": frozenset({"sclk_min_mhz", "sclk_max_mhz", "mclk_max_mhz", "vddgfx_offset_mv"}),
    "navi1x-curve": frozenset({"sclk_min_mhz", "sclk_max_mhz", "mclk_max_mhz"}),
    "apu": frozenset({"sclk_min_mhz", "sclk_max_mhz"}),
    "apu-cclk": frozenset({"sclk_min_mhz", "sclk_max_mhz"}),
}
# Layouts whose `r` restores the staging table only (no upload): `c` must follow.
R_NEEDS_COMMIT = frozenset({"navi1x-curve", "apu", "apu-cclk"})
# Layouts that check min/max against the other staged bound at once (order matters).
CROSSING_CHECKED = frozenset({"navi1x-curve", "navi2x", "apu", "apu-cclk"})
# APUs take OD writes only in manual mode (protocol §2, "Only allowed in manual mode").
NEEDS_MANUAL = frozenset({"apu", "apu-cclk"})
RDNA3_CURVE_ZONES = 6
UNITS = {"power_cap_w": "W", "sclk_offset_mhz": "MHz", "sclk_min_mhz": "MHz", "sclk_max_mhz": "MHz",
         "mclk_max_mhz": "MHz", "vddgfx_offset_mv": "mV"}


@dataclass(frozen=True)
class Write:
    """One `write()` to one file of the card. `file` is the attribute name; the apply
    path resolves it under the card's device (or hwmon) folder."""

    file: str
    value: str
    setting: str | None = None

    def __str__(self) -> str:
        return f"{self.file}: {self.value}"


@dataclass(frozen=True)
class CapLimits:
    """hwmon power1_cap_* in microwatts (None: the card does not print it)."""

    min_uw: int | None
    max_uw: int | None
    default_uw: int | None = None
    current_uw: int | None = None


@dataclass(frozen=True)
class Refusal:
    card: str
    setting: str
    value: int | str
    limit: str  # "outside the card's OD_RANGE SCLK_OFFSET -500…1000 MHz", "profile envelope max 250 W", ...

    def __str__(self) -> str:
        unit = UNITS.get(self.setting, "")
        return f"{self.card}: {self.setting}={self.value}{' ' + unit if unit else ''} refused: {self.limit}"


class PlanError(Exception):
    """Nothing may be written. `kind`: `refused` (a value outside a limit), `config` (the
    profile asks for what the card does not have), `od_disabled` (no pp_od_clk_voltage)."""

    def __init__(self, kind: str, card: str, problems: list[str], refusals: tuple[Refusal, ...] = ()) -> None:
        self.kind = kind
        self.card = card
        self.problems = problems
        self.refusals = refusals
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Plan:
    card: str
    profile: str
    format: str | None
    writes: tuple[Write, ...]
    # setting -> value the read-back must show (power_cap_w in whole watts;
    # vddc_curve_offset_mv[i] per zone on rdna3-curve)
    expected: Mapping[str, int] = field(default_factory=dict)
    # settings written that this kernel cannot print back (rdna4-limits' SCLK offset)
    unreadable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "expected", MappingProxyType(dict(self.expected)))


def _fmt_range(lo: int | None, hi: int | None, unit: str) -> str:
    return f"{'-∞' if lo is None else lo}…{'∞' if hi is None else hi} {unit}".strip()


def validate(card: str, profile: Profile, od: OdState | None, cap: CapLimits | None) -> list[Refusal]:
    """Every value against the card's range and the profile envelope. Empty = all inside."""
    out: list[Refusal] = []
    values = profile.values()
    for setting, value in values.items():
        unit = UNITS[setting]
        if setting == "power_cap_w":
            uw = value * 1_000_000
            if cap is not None and (
                (cap.min_uw is not None and uw < cap.min_uw) or (cap.max_uw is not None and uw > cap.max_uw)
            ):
                lo = None if cap.min_uw is None else cap.min_uw // 1_000_000
                hi = None if cap.max_uw is None else cap.max_uw // 1_000_000
                out.append(Refusal(card, setting, value, f"outside the card's power1_cap_min…max {_fmt_range(lo, hi, 'W')}"))
        elif od is not None:
            rng = od.ranges.get(setting)
            if rng is not None and not rng.min <= value <= rng.max:
                out.append(Refusal(card, setting, value, f"outside the card's OD_RANGE {_fmt_range(rng.min, rng.max, unit)}"))
            if setting == "vddgfx_offset_mv":
                if rng is None and od.format == "rdna3-curve":
                    rc = od.ranges.get("vddc_curve_offset_mv")
                    if rc is not None and not rc.min <= value <= rc.max:
                        out.append(Refusal(card, setting, value, f"outside the card's OD_RANGE VDDC_CURVE {_fmt_range(rc.min, rc.max, unit)}"))
                    rng = rc
                if rng is None and setting not in profile.envelope:
                    # Navi2x prints no VDDGFX_OFFSET range and does not check `vo` at all.
                    out.append(Refusal(card, setting, value, "no known range: the card prints no VDDGFX_OFFSET "
                                       "range; bound it with this profile's envelope.vddgfx_offset_mv"))
        if setting == "vddgfx_offset_mv" and value > 0 and not profile.allow_overvolt:
            out.append(Refusal(card, setting, value, "above 0 mV: positive voltage offsets need allow_overvolt: true"))
        env = profile.envelope.get(setting)
        if env is not None and ((env.min is not None and value < env.min) or (env.max is not None and value > env.max)):
            out.append(Refusal(card, setting, value, f"outside the profile envelope {_fmt_range(env.min, env.max, unit)}"))
    return out


def _od_problems(card: str, profile: Profile, od: OdState) -> list[str]:
    wanted = [k for k in OD_SETTINGS if getattr(profile, k) is not None]
    have = SUPPORTED.get(od.format, frozenset())
    probs = []
    for k in wanted:
        if k not in have and od.format in TABLE_FORMATS:
            probs.append(_table_problem(card, k, getattr(profile, k), od))
        elif k not in have:
            probs.append(f"{card}: profile setting {k} is not in this card's OD table (format {od.format}); "
                         f"it has {', '.join(sorted(have)) or 'no settable OD values'}")
        elif k == "vddgfx_offset_mv" and od.format == "rdna3-curve":
            if "vddc_curve_offset_mv" not in od.tables:
                probs.append(f"{card}: profile setting {k}: the card prints no OD_VDDC_CURVE")
        elif k not in od.settings and k not in od.ranges:
            # SMU13/14 gate each knob on a VBIOS feature bit: a section can be missing.
            probs.append(f"{card}: profile setting {k} is not in this card's OD table (its pp_od_clk_voltage "
                         f"has no such section; the VBIOS does not offer it)")
    return probs


TABLE_FORMATS = {"smu7-table": "SMU7 / Polaris", "vega10-table": "Vega10"}


def _table_problem(card: str, setting: str, value: int, od: OdState) -> str:
    """Per-level tables are read and checked, not written (yet): say so, with what the
    card's own table and OD_RANGE say about the value."""
    clk = setting.split("_", 1)[0]
    top = od.top_level(clk) if clk in ("sclk", "mclk") else None
    rng = od.ranges.get(f"{clk}_level_mhz")
    notes = []
    if top:
        notes.append(f"top {clk.upper()} level {top[0]} MHz @ {top[1]} mV")
    if rng and setting.endswith("_mhz") and setting != "sclk_offset_mhz":
        inside = rng.min <= value <= rng.max
        notes.append(f"{value} MHz is {'inside' if inside else 'outside'} OD_RANGE {clk.upper()} {rng.min}–{rng.max} MHz")
    return (f"{card}: profile setting {setting}: this card has a per-level OD table ({TABLE_FORMATS[od.format]}, "
            f"'OD_SCLK: N: <MHz> <mV>'); gpuguard reads and checks it but does not write per-level tables"
            + (f" ({'; '.join(notes)})" if notes else ""))


def _sclk_writes(od: OdState, lo: int | None, hi: int | None) -> list[Write]:
    cur_max = od.settings.get("sclk_max_mhz")
    min_w = Write(OD_FILE, f"s 0 {lo}", "sclk_min_mhz") if lo is not None else None
    max_w = Write(OD_FILE, f"s 1 {hi}", "sclk_max_mhz") if hi is not None else None
    order = [min_w, max_w]
    if od.format in CROSSING_CHECKED and lo is not None and cur_max is not None and lo > cur_max:
        # raising min above today's max: raise max first, or `s 0` is refused
        order = [max_w, min_w]
    return [w for w in order if w is not None]


def plan_apply(
    card: str,
    profile_name: str,
    profile: Profile,
    od: OdState | None,
    cap: CapLimits | None,
    od_missing_reason: str | None = None,
) -> Plan:
    """The writes that put `profile` on the card, in order. Raises PlanError with every
    problem found (nothing is written when any value is refused)."""
    wanted_od = [k for k in OD_SETTINGS if getattr(profile, k) is not None]
    if wanted_od and od is None:
        reason = od_missing_reason or "pp_od_clk_voltage is missing"
        raise PlanError("od_disabled", card, [f"{card}: cannot set {', '.join(wanted_od)}: {reason}"])
    if profile.power_cap_w is not None and (cap is None or (cap.min_uw is None and cap.max_uw is None and cap.current_uw is None)):
        raise PlanError("config", card, [f"{card}: profile setting power_cap_w: the card has no hwmon power1_cap"])
    if od is not None and wanted_od:
        probs = _od_problems(card, profile, od)
        if probs:
            raise PlanError("config", card, probs)
    refusals = validate(card, profile, od, cap)
    if od is not None and profile.sclk_min_mhz is not None and profile.sclk_max_mhz is None:
        cur = od.settings.get("sclk_max_mhz")
        if cur is not None and profile.sclk_min_mhz > cur:
            refusals.append(Refusal(card, "sclk_min_mhz", profile.sclk_min_mhz, f"above the card's current SCLK max {cur} MHz (min must not exceed max)"))
    if od is not None and profile.sclk_max_mhz is not None and profile.sclk_min_mhz is None:
        cur = od.settings.get("sclk_min_mhz")
        if cur is not None and profile.sclk_max_mhz < cur:
            refusals.append(Refusal(card, "sclk_max_mhz", profile.sclk_max_mhz, f"below the card's current SCLK min {cur} MHz (max must not be below min)"))
    if refusals:
        raise PlanError("refused", card, [str(r) for r in refusals], tuple(refusals))

    writes: list[Write] = []
    expected: dict[str, int] = {}
    unreadable: list[str] = []
    fmt = od.format if od is not None else None
    if profile.performance_level is not None:
        writes.append(Write(LEVEL_FILE, profile.performance_level, "performance_level"))
        expected["performance_level"] = profile.performance_level  # type: ignore[assignment]
    elif fmt in NEEDS_MANUAL and wanted_od:
        writes.append(Write(LEVEL_FILE, "manual", "performance_level"))
    if od is not None and wanted_od:
        if profile.sclk_offset_mhz is not None:
            if fmt == "rdna4-limits":
                # SMU14 before d9d4cb224e41 takes `s 1 <offset>` and prints the firmware
                # limits instead of the setting: the offset cannot be read back.
                writes.append(Write(OD_FILE, f"s 1 {profile.sclk_offset_mhz}", "sclk_offset_mhz"))
                unreadable.append("sclk_offset_mhz")
            else:
                writes.append(Write(OD_FILE, f"s {profile.sclk_offset_mhz}", "sclk_offset_mhz"))
                expected["sclk_offset_mhz"] = profile.sclk_offset_mhz
        for w in _sclk_writes(od, profile.sclk_min_mhz, profile.sclk_max_mhz):
            writes.append(w)
            expected[w.setting] = int(w.value.split()[-1])
        if profile.mclk_max_mhz is not None:
            writes.append(Write(OD_FILE, f"m 1 {profile.mclk_max_mhz}", "mclk_max_mhz"))
            expected["mclk_max_mhz"] = profile.mclk_max_mhz
        if profile.vddgfx_offset_mv is not None:
            if fmt == "rdna3-curve":
                # Linux 6.6 SMU13: six zone offsets, `vc <zone> <mV>` each.
                for zone in range(RDNA3_CURVE_ZONES):
                    writes.append(Write(OD_FILE, f"vc {zone} {profile.vddgfx_offset_mv}", f"vddc_curve_offset_mv[{zone}]"))
                    expected[f"vddc_curve_offset_mv[{zone}]"] = profile.vddgfx_offset_mv
            else:
                writes.append(Write(OD_FILE, f"vo {profile.vddgfx_offset_mv}", "vddgfx_offset_mv"))
                expected["vddgfx_offset_mv"] = profile.vddgfx_offset_mv
        writes.append(Write(OD_FILE, "c"))
    if profile.power_cap_w is not None:
        # after `c`: on RDNA3 the cap written after the OD commit is the one enforced
        writes.append(Write(CAP_FILE, str(profile.power_cap_w * 1_000_000), "power_cap_w"))
        expected["power_cap_w"] = profile.power_cap_w
    return Plan(card, profile_name, fmt, tuple(writes), expected, tuple(unreadable))


def plan_reset(card: str, od: OdState | None, cap: CapLimits | None) -> Plan:
    """`r` (+ `c` where the generation's `r` does not upload) and the default power cap.
    Expected afterwards: offsets 0 and the default cap; stock clock min/max are whatever
    the VBIOS boot table holds and are shown, not compared."""
    writes: list[Write] = []
    expected: dict[str, int] = {}
    if od is not None and od.format in SUPPORTED:
        writes.append(Write(OD_FILE, "r"))
        if od.format in R_NEEDS_COMMIT:
            writes.append(Write(OD_FILE, "c"))
        for k in ("sclk_offset_mhz", "vddgfx_offset_mv"):
            if k in od.settings:
                expected[k] = 0
        for i, _ in enumerate(od.tables.get("vddc_curve_offset_mv", ())):
            expected[f"vddc_curve_offset_mv[{i}]"] = 0
    if cap is not None and cap.default_uw:
        writes.append(Write(CAP_FILE, str(cap.default_uw), "power_cap_w"))
        expected["power_cap_w"] = cap.default_uw // 1_000_000
    if not writes:
        raise PlanError("config", card, [f"{card}: nothing to reset (no OD table and no power1_cap_default)"])
    return Plan(card, "stock", od.format if od else None, tuple(writes), expected)


def observed_values(od: OdState | None, cap_uw: int | None) -> dict[str, int]:
    """The read-back in the same keys as `Plan.expected`."""
    out: dict[str, int] = {}
    if od is not None:
        out.update({k: v for k, v in od.settings.items() if k in OD_SETTINGS or k == "mclk_min_mhz"})
        for i, v in enumerate(od.tables.get("vddc_curve_offset_mv", ())):
            out[f"vddc_curve_offset_mv[{i}]"] = v
    if cap_uw is not None:
        out["power_cap_w"] = cap_uw // 1_000_000  # the kernel keeps whole watts
    return out


def mismatches(expected: Mapping[str, int], observed: Mapping[str, int]) -> dict[str, tuple[int, int | None]]:
    """setting -> (expected, read back) for every value that did not read back equal."""
    return {k: (v, observed.get(k)) for k, v in expected.items() if observed.get(k) != v}
