"""Planning and validation against OD tables parsed from the reference dumps."""
import pytest

from gpuguard.hw.amdgpu_od import parse_od
from gpuguard.profiles.plan import CapLimits, PlanError, plan_apply, plan_reset
from gpuguard.profiles.schema import Bounds, Profile

CAP_R9700 = CapLimits(210_000_000, 300_000_000, 300_000_000, 300_000_000)


def od(reference, name):
    return parse_od((reference / "amdgpu" / f"{name}-pp_od_clk_voltage.txt").read_bytes())


def writes(plan):
    return [str(w) for w in plan.writes]


def test_rdna4_fixed_format_incident_profile(reference):
    p = plan_apply("r9700-a", "psu", Profile(power_cap_w=210, sclk_offset_mhz=-500, vddgfx_offset_mv=-100),
                   od(reference, "rdna4-rx9070xt-fixedformat-commitmsg"), CAP_R9700)
    assert writes(p) == ["pp_od_clk_voltage: s -500", "pp_od_clk_voltage: vo -100", "pp_od_clk_voltage: c",
                         "power1_cap: 210000000"]


def test_rdna4_old_format_uses_s1_and_is_unreadable(reference):
    p = plan_apply("g", "psu", Profile(sclk_offset_mhz=-500), od(reference, "rdna4-rx9070xt-powercolor-mar2025"), None)
    assert writes(p) == ["pp_od_clk_voltage: s 1 -500", "pp_od_clk_voltage: c"]
    assert p.unreadable == ("sclk_offset_mhz",)


def test_rdna3_curve_kernel_66_writes_zone_offsets(reference):
    p = plan_apply("g", "x", Profile(vddgfx_offset_mv=-100), od(reference, "rdna3-rx7900xtx-linux66-transcribed"), None)
    assert writes(p)[:2] == ["pp_od_clk_voltage: vc 0 -100", "pp_od_clk_voltage: vc 1 -100"]
    assert len(p.writes) == 7 and p.expected["vddc_curve_offset_mv[5]"] == -100


def test_navi2x_min_above_current_max_writes_max_first(reference):
    o = od(reference, "rdna2-rx6800")
    cur_max = o.settings["sclk_max_mhz"]
    p = plan_apply("g", "x", Profile(sclk_min_mhz=cur_max + 50, sclk_max_mhz=cur_max + 100), o, None)
    assert writes(p)[:2] == [f"pp_od_clk_voltage: s 1 {cur_max + 100}", f"pp_od_clk_voltage: s 0 {cur_max + 50}"]
    p = plan_apply("g", "x", Profile(sclk_min_mhz=500, sclk_max_mhz=1500), o, None)
    assert writes(p)[:2] == ["pp_od_clk_voltage: s 0 500", "pp_od_clk_voltage: s 1 1500"]


def test_navi2x_vo_without_range_needs_envelope(reference):
    o = od(reference, "rdna2-rx6800")
    with pytest.raises(PlanError) as e:
        plan_apply("g", "x", Profile(vddgfx_offset_mv=-50), o, None)
    assert "envelope.vddgfx_offset_mv" in str(e.value)
    p = plan_apply("g", "x", Profile(vddgfx_offset_mv=-50, envelope={"vddgfx_offset_mv": Bounds(min=-100, max=0)}), o, None)
    assert "pp_od_clk_voltage: vo -50" in writes(p)


def test_navi1x_reset_needs_commit(reference):
    assert writes(plan_reset("g", od(reference, "rdna1-rx5700xt"), None)) == ["pp_od_clk_voltage: r", "pp_od_clk_voltage: c"]
    assert writes(plan_reset("g", od(reference, "rdna3-rx7900xtx-nitro-e471"), None)) == ["pp_od_clk_voltage: r"]


def test_setting_the_card_lacks_is_a_config_error_naming_card_and_setting(reference):
    with pytest.raises(PlanError) as e:
        plan_apply("xtx-a", "x", Profile(sclk_offset_mhz=-500), od(reference, "rdna3-rx7900xtx-nitro-e471"), None)
    assert e.value.kind == "config" and "xtx-a" in str(e.value) and "sclk_offset_mhz" in str(e.value)


def test_refusals_name_value_limit_and_card(reference):
    o = od(reference, "rdna4-rx9070xt-fixedformat-commitmsg")
    with pytest.raises(PlanError) as e:
        plan_apply("r9700-b", "x", Profile(power_cap_w=200, vddgfx_offset_mv=50, allow_overvolt=True,
                                           envelope={"power_cap_w": Bounds(max=250)}), o, CAP_R9700)
    text = str(e.value)
    assert e.value.kind == "refused"
    assert "r9700-b: power_cap_w=200 W refused: outside the card's power1_cap_min…max 210…300 W" in text
    assert "vddgfx_offset_mv=50 mV refused: outside the card's OD_RANGE -200…0 mV" in text
    with pytest.raises(PlanError) as e:
        plan_apply("g", "x", Profile(power_cap_w=280, envelope={"power_cap_w": Bounds(max=250)}), o, CAP_R9700)
    assert "outside the profile envelope -∞…250 W" in str(e.value)


def test_positive_offset_refused_without_allow_overvolt(reference):
    o = od(reference, "rdna3-rx7900xtx-nitro-e471")
    o2 = type(o)(o.format, o.settings, {**o.ranges, "vddgfx_offset_mv": type(o.ranges["sclk_max_mhz"])(-450, 100)}, o.tables)
    with pytest.raises(PlanError) as e:
        plan_apply("g", "x", Profile(vddgfx_offset_mv=20), o2, None)
    assert "allow_overvolt" in str(e.value)
    assert "pp_od_clk_voltage: vo 20" in writes(plan_apply("g", "x", Profile(vddgfx_offset_mv=20, allow_overvolt=True), o2, None))


def test_od_disabled_is_a_finding_not_a_retry():
    with pytest.raises(PlanError) as e:
        plan_apply("g", "x", Profile(sclk_offset_mhz=-500), None, CAP_R9700,
                   "OD is disabled at module load: add amdgpu.ppfeaturemask=0xfff7ffff")
    assert e.value.kind == "od_disabled" and "ppfeaturemask" in str(e.value)
    # a cap-only profile still works without OD
    assert [str(w) for w in plan_apply("g", "x", Profile(power_cap_w=250), None, CAP_R9700).writes] == ["power1_cap: 250000000"]


def test_never_plans_pp_dpm_writes(reference):
    p = plan_apply("g", "x", Profile(sclk_min_mhz=500, sclk_max_mhz=2000, mclk_max_mhz=1200, vddgfx_offset_mv=-50,
                                     performance_level="manual"), od(reference, "rdna3-rx7900xtx-nitro-e471"), None)
    assert not any(w.file.startswith("pp_dpm_") for w in p.writes)


def test_a_value_missing_from_the_read_back_is_a_mismatch():
    """Absent is not equal: a setting the read-back lacks must never count as verified."""
    from gpuguard.profiles.plan import mismatches

    assert mismatches({"power_cap_w": 210, "sclk_offset_mhz": -500}, {"power_cap_w": 210}) == {
        "sclk_offset_mhz": (-500, None)}
    assert mismatches({"power_cap_w": 210}, {"power_cap_w": 210, "extra": 1}) == {}
