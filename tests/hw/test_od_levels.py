"""Per-level OD tables (issue 14): the Polaris (SMU7) and Vega10 `pp_od_clk_voltage` dumps in
reference/amdgpu/ print `OD_SCLK: 0: 300MHz 750mV …`; every level is parsed with clock
and voltage, shown in `status --json` and the status table, and the planner says plainly
that it checks but does not write these tables."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.cli.status import od_summary
from gpuguard.hw.amdgpu_od import parse_od
from gpuguard.profiles.plan import PlanError, plan_apply
from gpuguard.profiles.schema import Profile
from gpuguard.state.snapshot import GpuSnapshot

REF = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "amdgpu"
# dump -> (format, top SCLK (MHz, mV), top MCLK (MHz, mV), SCLK levels, MCLK levels)
TOP = {
    "gcn4-rx580": ("smu7-table", (1366, 1150), (1750, 975), 8, 3),
    "gcn5-vega56": ("vega10-table", (1590, 1200), (920, 950), 8, 4),
}


def dumps() -> dict[str, bytes]:
    if not REF.is_dir():
        pytest.skip(f"reference dumps not found at {REF}")
    return {p.name.removesuffix("-pp_od_clk_voltage.txt"): p.read_bytes() for p in REF.glob("*-pp_od_clk_voltage.txt")}


def test_every_per_level_dump_in_the_reference_folder_is_asserted():
    per_level = {name for name, data in dumps().items() if parse_od(data).format in ("smu7-table", "vega10-table")}
    assert per_level == set(TOP)  # a new per-level dump must get its top levels asserted here


@pytest.mark.parametrize("name", sorted(TOP))
def test_per_level_dump_top_levels(name):
    fmt, sclk_top, mclk_top, n_sclk, n_mclk = TOP[name]
    od = parse_od(dumps()[name])
    assert od.format == fmt
    lv = od.levels()
    assert len(lv["sclk"]) == n_sclk and len(lv["mclk"]) == n_mclk
    assert (lv["sclk"][-1]["mhz"], lv["sclk"][-1]["mv"]) == sclk_top
    assert (lv["mclk"][-1]["mhz"], lv["mclk"][-1]["mv"]) == mclk_top
    assert od.top_level("sclk") == sclk_top and [r["level"] for r in lv["sclk"]] == list(range(n_sclk))
    snap = GpuSnapshot(name="c", bdf="0000:01:00.0", vendor="1002", device_id="67df", driver="amdgpu",
                       model=name, card="card0", up=True, time=0.0, od=od)
    d = snap.to_dict()["od"]
    assert d["levels"]["sclk"][-1] == {"level": n_sclk - 1, "mhz": sclk_top[0], "mv": sclk_top[1]}
    summary = od_summary(d, None)
    assert f"sclk≤{sclk_top[0]}@{sclk_top[1]}mV" in summary and f"mclk≤{mclk_top[0]}@{mclk_top[1]}mV" in summary


def test_planner_checks_per_level_tables_and_says_writes_are_unsupported():
    od = parse_od(dumps()["gcn4-rx580"])
    with pytest.raises(PlanError) as e:
        plan_apply("rx580", "cap", Profile(sclk_max_mhz=2100), od, None)
    msg = " ".join(e.value.problems)
    assert "per-level OD table (SMU7 / Polaris" in msg and "does not write per-level tables" in msg
    assert "top SCLK level 1366 MHz @ 1150 mV" in msg and "2100 MHz is outside OD_RANGE SCLK 300–2000 MHz" in msg
