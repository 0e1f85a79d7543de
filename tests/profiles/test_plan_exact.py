"""Exact plans, exact refusals: every write (file, bytes, the setting it carries), every
value the read-back must show, and the words of every refusal, on hand-built OD tables
whose numbers make each limit's edge visible. bench/mutation.sh found these unobserved."""
from __future__ import annotations

import pytest

from gpuguard.profiles.plan import (
    CAP_FILE,
    LEVEL_FILE,
    OD_FILE,
    CapLimits,
    Plan,
    PlanError,
    Refusal,
    Write,
    observed_values,
    plan_apply,
    plan_reset,
    validate,
)
from gpuguard.profiles.schema import Bounds, Profile
from gpuguard.state.snapshot import OdRange, OdState

CAP = CapLimits(min_uw=210_000_000, max_uw=300_000_000, default_uw=300_000_000, current_uw=300_000_000)


def od(fmt: str, settings=None, ranges=None, tables=None) -> OdState:
    return OdState(fmt, dict(settings or {}), {k: v if isinstance(v, OdRange) else OdRange(*v) for k, v in (ranges or {}).items()}, dict(tables or {}))


RDNA4 = od("rdna4", {"sclk_offset_mhz": 0, "mclk_min_mhz": 97, "mclk_max_mhz": 1259, "vddgfx_offset_mv": 0},
           {"sclk_offset_mhz": (-500, 1000), "mclk_max_mhz": (97, 1500), "vddgfx_offset_mv": (-200, 0)})
RDNA3 = od("rdna3", {"sclk_min_mhz": 500, "sclk_max_mhz": 2735, "mclk_max_mhz": 1250, "vddgfx_offset_mv": 0},
           {"sclk_min_mhz": (500, 5000), "sclk_max_mhz": (500, 5000), "mclk_max_mhz": (97, 1500),
            "vddgfx_offset_mv": (-450, 0)})
CURVE = od("rdna3-curve", {"sclk_min_mhz": 500, "sclk_max_mhz": 3005, "mclk_max_mhz": 1250},
           {"sclk_min_mhz": (500, 5000), "sclk_max_mhz": (500, 5000), "vddc_curve_offset_mv": (-450, 0)},
           {"vddc_curve_offset_mv": (0, 0, 0, 0, 0, 0)})
NAVI2X = od("navi2x", {"sclk_min_mhz": 500, "sclk_max_mhz": 2314, "mclk_max_mhz": 1000, "vddgfx_offset_mv": 0},
            {"sclk_min_mhz": (500, 2600), "sclk_max_mhz": (500, 2600), "mclk_max_mhz": (674, 1075)})
NAVI1X = od("navi1x-curve", {"sclk_min_mhz": 800, "sclk_max_mhz": 1900, "mclk_max_mhz": 875},
            {"sclk_min_mhz": (800, 2150), "sclk_max_mhz": (800, 2150), "mclk_max_mhz": (625, 950)})
APU = od("apu", {"sclk_min_mhz": 800, "sclk_max_mhz": 2700}, {"sclk_min_mhz": (800, 2700), "sclk_max_mhz": (800, 2700)})
SMU7 = od("smu7-table", {}, {"sclk_level_mhz": (300, 2000), "mclk_level_mhz": (300, 2250)},
          {"sclk_levels": ((300, 750), (1366, 1150)), "mclk_levels": ((300, 750), (1750, 975))})


def refused(card, profile, o, cap=None) -> PlanError:
    with pytest.raises(PlanError) as e:
        plan_apply(card, "p", profile, o, cap)
    return e.value


# ------------------------------------------------------------------ validate: every limit's edge


@pytest.mark.parametrize("watts,ok", [(209, False), (210, True), (300, True), (301, False)])
def test_power_cap_edges_are_the_cards_own(watts, ok):
    out = validate("g", Profile(power_cap_w=watts), None, CAP)
    assert out == ([] if ok else [Refusal("g", "power_cap_w", watts, "outside the card's power1_cap_min…max 210…300 W")])


def test_power_cap_with_one_limit_unknown():
    assert validate("g", Profile(power_cap_w=400), None, CapLimits(None, 300_000_000)) == [
        Refusal("g", "power_cap_w", 400, "outside the card's power1_cap_min…max -∞…300 W")]
    assert validate("g", Profile(power_cap_w=100), None, CapLimits(210_000_000, None)) == [
        Refusal("g", "power_cap_w", 100, "outside the card's power1_cap_min…max 210…∞ W")]
    assert validate("g", Profile(power_cap_w=100), None, CapLimits(None, None, current_uw=1)) == []
    assert validate("g", Profile(power_cap_w=100), None, None) == []


@pytest.mark.parametrize("mhz,ok", [(-501, False), (-500, True), (1000, True), (1001, False)])
def test_od_range_edges(mhz, ok):
    out = validate("g", Profile(sclk_offset_mhz=mhz), RDNA4, None)
    assert out == ([] if ok else [Refusal("g", "sclk_offset_mhz", mhz, "outside the card's OD_RANGE -500…1000 MHz")])


def test_rdna3_curve_voltage_is_checked_against_the_curve_range():
    assert validate("g", Profile(vddgfx_offset_mv=-450), CURVE, None) == []
    assert validate("g", Profile(vddgfx_offset_mv=0), CURVE, None) == []
    assert validate("g", Profile(vddgfx_offset_mv=-451), CURVE, None) == [
        Refusal("g", "vddgfx_offset_mv", -451, "outside the card's OD_RANGE VDDC_CURVE -450…0 mV")]


def test_voltage_without_a_range_needs_the_envelope():
    assert validate("g", Profile(vddgfx_offset_mv=-50), NAVI2X, None) == [
        Refusal("g", "vddgfx_offset_mv", -50, "no known range: the card prints no VDDGFX_OFFSET range; bound "
                "it with this profile's envelope.vddgfx_offset_mv")]
    bounded = Profile(vddgfx_offset_mv=-50, envelope={"vddgfx_offset_mv": Bounds(min=-100, max=0)})
    assert validate("g", bounded, NAVI2X, None) == []
    # a curve card without a curve range has no range either
    no_curve_range = od("rdna3-curve", CURVE.settings, {}, CURVE.tables)
    assert [r.limit[:14] for r in validate("g", Profile(vddgfx_offset_mv=-50), no_curve_range, None)] == ["no known range"]
    # ... but one that prints a VDDGFX_OFFSET range is checked against that range alone
    own_range = od("rdna3-curve", CURVE.settings, {"vddgfx_offset_mv": (-200, 0)}, CURVE.tables)
    assert validate("g", Profile(vddgfx_offset_mv=-100), own_range, None) == []


def test_positive_voltage_needs_allow_overvolt_zero_does_not():
    wide = od("rdna3", RDNA3.settings, {"vddgfx_offset_mv": (-450, 100)})
    assert validate("g", Profile(vddgfx_offset_mv=0), wide, None) == []
    assert validate("g", Profile(vddgfx_offset_mv=1), wide, None) == [
        Refusal("g", "vddgfx_offset_mv", 1, "above 0 mV: positive voltage offsets need allow_overvolt: true")]
    assert validate("g", Profile(vddgfx_offset_mv=1, allow_overvolt=True), wide, None) == []


@pytest.mark.parametrize("mhz,ok", [(-301, False), (-300, True), (-100, True), (-99, False)])
def test_envelope_edges(mhz, ok):
    p = Profile(sclk_offset_mhz=mhz, envelope={"sclk_offset_mhz": Bounds(min=-300, max=-100)})
    out = validate("g", p, RDNA4, None)
    assert out == ([] if ok else [Refusal("g", "sclk_offset_mhz", mhz, "outside the profile envelope -300…-100 MHz")])


def test_envelope_with_one_side():
    assert validate("g", Profile(power_cap_w=280, envelope={"power_cap_w": Bounds(max=250)}), None, CAP) == [
        Refusal("g", "power_cap_w", 280, "outside the profile envelope -∞…250 W")]
    assert validate("g", Profile(power_cap_w=220, envelope={"power_cap_w": Bounds(min=250)}), None, CAP) == [
        Refusal("g", "power_cap_w", 220, "outside the profile envelope 250…∞ W")]


def test_refusal_text():
    assert str(Refusal("r9700-b", "power_cap_w", 200, "x")) == "r9700-b: power_cap_w=200 W refused: x"
    assert str(Refusal("g", "performance_level", "high", "y")) == "g: performance_level=high refused: y"


# ------------------------------------------------------------------ plan_apply: exact refusals


def test_refusals_carry_every_problem_in_order():
    e = refused("r9700-b", Profile(power_cap_w=200, sclk_offset_mhz=1001, vddgfx_offset_mv=-201), RDNA4, CAP)
    assert e.kind == "refused" and e.card == "r9700-b"
    assert e.problems == [
        "r9700-b: power_cap_w=200 W refused: outside the card's power1_cap_min…max 210…300 W",
        "r9700-b: sclk_offset_mhz=1001 MHz refused: outside the card's OD_RANGE -500…1000 MHz",
        "r9700-b: vddgfx_offset_mv=-201 mV refused: outside the card's OD_RANGE -200…0 mV",
    ]
    assert [r.setting for r in e.refusals] == ["power_cap_w", "sclk_offset_mhz", "vddgfx_offset_mv"]
    assert str(e) == "; ".join(e.problems)


def test_od_missing_names_what_cannot_be_set():
    e = refused("g", Profile(sclk_offset_mhz=-500, vddgfx_offset_mv=-50, power_cap_w=250), None, CAP)
    assert (e.kind, e.card, e.problems) == ("od_disabled", "g", ["g: cannot set sclk_offset_mhz, vddgfx_offset_mv: "
                                                    "pp_od_clk_voltage is missing"])
    with pytest.raises(PlanError) as ei:
        plan_apply("g", "p", Profile(sclk_offset_mhz=-500), None, None, "OD is off: add amdgpu.ppfeaturemask")
    assert ei.value.problems == ["g: cannot set sclk_offset_mhz: OD is off: add amdgpu.ppfeaturemask"]


@pytest.mark.parametrize("cap", [None, CapLimits(None, None, default_uw=300_000_000)])
def test_power_cap_on_a_card_without_one(cap):
    e = refused("g", Profile(power_cap_w=250), None, cap)
    assert (e.kind, e.card, e.problems) == ("config", "g", ["g: profile setting power_cap_w: the card has no hwmon power1_cap"])


def test_power_cap_when_only_the_current_cap_is_printed():
    p = plan_apply("g", "p", Profile(power_cap_w=250), None, CapLimits(None, None, None, 300_000_000))
    assert p.writes == (Write(CAP_FILE, "250000000", "power_cap_w"),)


def test_settings_the_card_does_not_have():
    e = refused("xtx", Profile(sclk_offset_mhz=-500, sclk_min_mhz=600), RDNA3)
    assert (e.kind, e.card, e.problems) == ("config", "xtx", [
        "xtx: profile setting sclk_offset_mhz is not in this card's OD table (format rdna3); it has mclk_max_mhz, "
        "sclk_max_mhz, sclk_min_mhz, vddgfx_offset_mv"])
    e = refused("g", Profile(sclk_max_mhz=1000), od("empty"))
    assert e.problems == ["g: profile setting sclk_max_mhz is not in this card's OD table (format empty); it has "
                          "no settable OD values"]
    e = refused("g", Profile(vddgfx_offset_mv=-50), od("rdna3-curve", CURVE.settings, CURVE.ranges))
    assert e.problems == ["g: profile setting vddgfx_offset_mv: the card prints no OD_VDDC_CURVE"]
    e = refused("g", Profile(mclk_max_mhz=1000, vddgfx_offset_mv=-50), od("rdna4", {"sclk_offset_mhz": 0}))
    assert e.problems == [
        "g: profile setting mclk_max_mhz is not in this card's OD table (its pp_od_clk_voltage has no such "
        "section; the VBIOS does not offer it)",
        "g: profile setting vddgfx_offset_mv is not in this card's OD table (its pp_od_clk_voltage has no such "
        "section; the VBIOS does not offer it)"]
    # a setting present only as a range is offered
    only_range = od("rdna4", {}, {"mclk_max_mhz": (97, 1500)})
    assert plan_apply("g", "p", Profile(mclk_max_mhz=1000), only_range, None).writes[0] == Write(OD_FILE, "m 1 1000", "mclk_max_mhz")


def test_per_level_tables_are_read_not_written():
    e = refused("rx580", Profile(sclk_max_mhz=1500, mclk_max_mhz=2500, sclk_offset_mhz=-100, vddgfx_offset_mv=-50), SMU7)
    head = "this card has a per-level OD table (SMU7 / Polaris, 'OD_SCLK: N: <MHz> <mV>'); gpuguard reads and " \
           "checks it but does not write per-level tables"
    assert (e.kind, e.problems) == ("config", [
        f"rx580: profile setting sclk_offset_mhz: {head} (top SCLK level 1366 MHz @ 1150 mV)",
        f"rx580: profile setting sclk_max_mhz: {head} (top SCLK level 1366 MHz @ 1150 mV; 1500 MHz is inside "
        "OD_RANGE SCLK 300–2000 MHz)",
        f"rx580: profile setting mclk_max_mhz: {head} (top MCLK level 1750 MHz @ 975 mV; 2500 MHz is outside "
        "OD_RANGE MCLK 300–2250 MHz)",
        f"rx580: profile setting vddgfx_offset_mv: {head}",
    ])
    vega = od("vega10-table", {}, {"sclk_level_mhz": (852, 2400)})
    e = refused("rx580", Profile(sclk_max_mhz=300), SMU7)
    assert e.problems[0].endswith("(top SCLK level 1366 MHz @ 1150 mV; 300 MHz is inside OD_RANGE SCLK 300–2000 MHz)")
    e = refused("v56", Profile(sclk_min_mhz=2400), vega)
    assert e.problems == ["v56: profile setting sclk_min_mhz: this card has a per-level OD table (Vega10, "
                          "'OD_SCLK: N: <MHz> <mV>'); gpuguard reads and checks it but does not write per-level "
                          "tables (2400 MHz is inside OD_RANGE SCLK 852–2400 MHz)"]


def test_min_alone_above_the_current_max_and_max_alone_below_the_current_min():
    e = refused("g", Profile(sclk_min_mhz=2315), NAVI2X)
    assert e.problems == ["g: sclk_min_mhz=2315 MHz refused: above the card's current SCLK max 2314 MHz (min must "
                          "not exceed max)"]
    assert plan_apply("g", "p", Profile(sclk_min_mhz=2314), NAVI2X, None).expected == {"sclk_min_mhz": 2314}
    e = refused("g", Profile(sclk_max_mhz=799), od("navi2x", {"sclk_min_mhz": 800}, {"sclk_max_mhz": (500, 2600)}))
    assert e.problems == ["g: sclk_max_mhz=799 MHz refused: below the card's current SCLK min 800 MHz (max must not "
                          "be below min)"]
    assert plan_apply("g", "p", Profile(sclk_max_mhz=800), od("navi2x", {"sclk_min_mhz": 800}, {"sclk_max_mhz": (500, 2600)}),
                      None).expected == {
        "sclk_max_mhz": 800}
    # a card that prints no current bound: nothing to compare with
    assert plan_apply("g", "p", Profile(sclk_min_mhz=600), od("navi2x", {}, {"sclk_min_mhz": (500, 2600)}), None).writes[0] \
        == Write(OD_FILE, "s 0 600", "sclk_min_mhz")


# ------------------------------------------------------------------ plan_apply: exact writes


def test_rdna4_full_plan():
    p = plan_apply("r9700-a", "psu-safe", Profile(power_cap_w=210, sclk_offset_mhz=-500, mclk_max_mhz=1200,
                                                  vddgfx_offset_mv=-100), RDNA4, CAP)
    assert p == Plan("r9700-a", "psu-safe", "rdna4", (
        Write(OD_FILE, "s -500", "sclk_offset_mhz"),
        Write(OD_FILE, "m 1 1200", "mclk_max_mhz"),
        Write(OD_FILE, "vo -100", "vddgfx_offset_mv"),
        Write(OD_FILE, "c"),
        Write(CAP_FILE, "210000000", "power_cap_w"),
    ), {"sclk_offset_mhz": -500, "mclk_max_mhz": 1200, "vddgfx_offset_mv": -100, "power_cap_w": 210}, ())


def test_rdna4_limits_offset_is_written_as_s1_and_cannot_be_read_back():
    o = od("rdna4-limits", {"mclk_max_mhz": 1259}, {"sclk_offset_mhz": (-500, 1000)})
    p = plan_apply("g", "p", Profile(sclk_offset_mhz=-500), o, None)
    assert (p.writes, dict(p.expected), p.unreadable) == (
        (Write(OD_FILE, "s 1 -500", "sclk_offset_mhz"), Write(OD_FILE, "c")), {}, ("sclk_offset_mhz",))


def test_rdna3_curve_writes_six_zones():
    p = plan_apply("g", "p", Profile(vddgfx_offset_mv=-100), CURVE, None)
    assert p.writes == tuple(Write(OD_FILE, f"vc {z} -100", f"vddc_curve_offset_mv[{z}]") for z in range(6)) + (
        Write(OD_FILE, "c"),)
    assert dict(p.expected) == {f"vddc_curve_offset_mv[{z}]": -100 for z in range(6)}


@pytest.mark.parametrize("o,lo,hi,first", [
    (NAVI2X, 2400, 2500, "max"),  # raising min above today's max (2314): max first
    (NAVI2X, 2314, 2500, "min"),  # min equal to today's max is accepted as it is
    (NAVI1X, 2000, 2100, "max"),
    (APU, 2500, 2600, "min"),  # 2500 is not above the APU's 2700
    (RDNA3, 2800, 2900, "min"),  # RDNA3 does not check one bound against the other
    (NAVI2X, 600, 1500, "min"),
])
def test_sclk_bounds_order(o, lo, hi, first):
    p = plan_apply("g", "p", Profile(sclk_min_mhz=lo, sclk_max_mhz=hi), o, None)
    mn, mx = Write(OD_FILE, f"s 0 {lo}", "sclk_min_mhz"), Write(OD_FILE, f"s 1 {hi}", "sclk_max_mhz")
    od_writes = [w for w in p.writes if w.file == OD_FILE and w.value != "c"]
    assert od_writes == ([mx, mn] if first == "max" else [mn, mx])
    assert {k: p.expected[k] for k in ("sclk_min_mhz", "sclk_max_mhz")} == {"sclk_min_mhz": lo, "sclk_max_mhz": hi}


def test_sclk_order_when_the_card_prints_no_current_max():
    o = od("navi2x", {}, {"sclk_min_mhz": (500, 2600), "sclk_max_mhz": (500, 2600)})
    assert plan_apply("g", "p", Profile(sclk_min_mhz=2400, sclk_max_mhz=2500), o, None).writes[:2] == (
        Write(OD_FILE, "s 0 2400", "sclk_min_mhz"), Write(OD_FILE, "s 1 2500", "sclk_max_mhz"))


def test_performance_level_first_and_apus_in_manual_mode():
    p = plan_apply("g", "p", Profile(performance_level="high", mclk_max_mhz=1000), NAVI2X, None)
    assert p.writes == (Write(LEVEL_FILE, "high", "performance_level"), Write(OD_FILE, "m 1 1000", "mclk_max_mhz"),
                        Write(OD_FILE, "c"))
    assert dict(p.expected) == {"performance_level": "high", "mclk_max_mhz": 1000}
    p = plan_apply("apu", "p", Profile(sclk_max_mhz=2000), APU, None)
    assert p.writes == (Write(LEVEL_FILE, "manual", "performance_level"), Write(OD_FILE, "s 1 2000", "sclk_max_mhz"),
                        Write(OD_FILE, "c"))
    assert dict(p.expected) == {"sclk_max_mhz": 2000}  # manual is the means, not the profile's ask
    p = plan_apply("apu", "p", Profile(performance_level="auto", sclk_max_mhz=2000), APU, None)
    assert p.writes[0] == Write(LEVEL_FILE, "auto", "performance_level")
    # nothing for OD on an APU: no manual mode either
    p = plan_apply("apu", "p", Profile(power_cap_w=15), APU, CapLimits(5_000_000, 30_000_000))
    assert p.writes == (Write(CAP_FILE, "15000000", "power_cap_w"),)
    assert (p.format, dict(p.expected)) == ("apu", {"power_cap_w": 15})


def test_a_plans_expected_values_are_read_only():
    p = plan_apply("g", "cap", Profile(power_cap_w=250), RDNA4, CAP)
    with pytest.raises(TypeError):
        p.expected["power_cap_w"] = 300  # type: ignore[index]


def test_power_cap_only_plan_has_no_commit():
    p = plan_apply("g", "cap", Profile(power_cap_w=250), RDNA4, CAP)
    assert p == Plan("g", "cap", "rdna4", (Write(CAP_FILE, "250000000", "power_cap_w"),), {"power_cap_w": 250})


# ------------------------------------------------------------------ plan_reset


def test_reset_plans():
    p = plan_reset("g", RDNA4, CAP)
    assert p == Plan("g", "stock", "rdna4", (Write(OD_FILE, "r"), Write(CAP_FILE, "300000000", "power_cap_w")),
                     {"sclk_offset_mhz": 0, "vddgfx_offset_mv": 0, "power_cap_w": 300})
    p = plan_reset("g", NAVI1X, None)
    assert p == Plan("g", "stock", "navi1x-curve", (Write(OD_FILE, "r"), Write(OD_FILE, "c")), {})
    p = plan_reset("g", CURVE, CapLimits(None, None, default_uw=263_500_000))
    assert p.writes == (Write(OD_FILE, "r"), Write(CAP_FILE, "263500000", "power_cap_w"))
    assert dict(p.expected) == {**{f"vddc_curve_offset_mv[{i}]": 0 for i in range(6)}, "power_cap_w": 263}
    p = plan_reset("g", None, CAP)
    assert p == Plan("g", "stock", None, (Write(CAP_FILE, "300000000", "power_cap_w"),), {"power_cap_w": 300})
    p = plan_reset("g", SMU7, CAP)  # a per-level table is not reset by gpuguard: only the cap
    assert p.writes == (Write(CAP_FILE, "300000000", "power_cap_w"),) and p.format == "smu7-table"


@pytest.mark.parametrize("o,cap", [(None, None), (SMU7, None), (None, CapLimits(210_000_000, 300_000_000)),
                                   (None, CapLimits(None, None, default_uw=0))])
def test_nothing_to_reset(o, cap):
    with pytest.raises(PlanError) as e:
        plan_reset("g", o, cap)
    assert (e.value.kind, e.value.card, e.value.problems) == (
        "config", "g", ["g: nothing to reset (no OD table and no power1_cap_default)"])


# ------------------------------------------------------------------ read-back keys


def test_observed_values_use_the_plans_keys():
    o = od("apu-cclk", {"sclk_min_mhz": 1600, "sclk_max_mhz": 1600, "cclk_min_mhz": 1400, "mclk_min_mhz": 97})
    assert observed_values(o, 15_999_999) == {"sclk_min_mhz": 1600, "sclk_max_mhz": 1600, "mclk_min_mhz": 97,
                                              "power_cap_w": 15}
    assert observed_values(CURVE, None) == {"sclk_min_mhz": 500, "sclk_max_mhz": 3005, "mclk_max_mhz": 1250,
                                            **{f"vddc_curve_offset_mv[{i}]": 0 for i in range(6)}}
    assert observed_values(None, 210_000_000) == {"power_cap_w": 210}
    assert observed_values(None, None) == {}
