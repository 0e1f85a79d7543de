"""Every file in reference/amdgpu parses with its kind's parser, with values asserted: a
sweep with an independent oracle for the plain numeric files, and hand-checked tables
(read off the dumps) for every structured file. Bad content is rejected naming the file."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.hw import amdgpu_files as f
from gpuguard.hw.amdgpu import parser_for
from gpuguard.hw.amdgpu_files import AmdgpuFormatError

# Plain numeric kinds: (parser, divisor from the raw integer to the base unit).
NUMERIC = {
    f.parse_microwatts: 1e6,
    f.parse_millicelsius: 1e3,
    f.parse_millivolts: 1e3,
    f.parse_hertz: 1,
    f.parse_rpm: 1,
    f.parse_bytes: 1,
    f.parse_link_width: 1,
    f.parse_percent_ratio: 100,
}


def attribute(entry: dict) -> str:
    return entry["fname"].replace("hwmon-", "").replace("-", "/")


def test_every_reference_file_has_a_parser(manifest, amdgpu_ref):
    on_disk = {p.name for p in amdgpu_ref.glob("*.txt")}
    assert on_disk == {e["file"] for e in manifest}  # the sweep covers the whole folder
    for e in manifest:
        parser_for(attribute(e))  # KeyError = a kind with no parser


def _entries() -> list[dict]:
    # Parametrize needs the list at collection time (fixtures come later); same location
    # rule as tests/conftest.py. Absent corpus = empty list = the sweep is skipped.
    here = Path(__file__).resolve().parents[2]
    ref = Path(os.environ.get("GPUGUARD_REFERENCE", here.parent / "shared" / "reference")) / "amdgpu" / "MANIFEST.json"
    return json.loads(ref.read_text()) if ref.is_file() else []


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: e["file"])
def test_sweep_parses_with_values(amdgpu_ref, entry):
    data = (amdgpu_ref / entry["file"]).read_bytes()
    parse = parser_for(attribute(entry))
    value = parse(data, entry["file"])
    raw = data.replace(b"\0", b"").strip()
    if parse in NUMERIC:
        # Independent oracle: the integer the kernel printed, scaled to base units.
        assert value == int(raw) / NUMERIC[parse]
    elif parse is f.parse_label:
        assert value == raw.decode()
    elif parse is f.parse_dpm:
        # One level per non-blank line, and '*' marks exactly the lines that carry one.
        lines = [ln for ln in raw.decode().split("\n") if ln.strip()]
        assert len(value.levels) == len(lines)
        assert [lv.active for lv in value.levels] == ["*" in ln for ln in lines]
    else:
        assert value is not None or parse is f.parse_unique_id


DPM_SCLK = {  # dump: (levels, MHz of the '*' level)
    "apu-phoenix-phoenix-15bf": (3, 800),
    "apu-strixpoint-strixpoint-150e": (3, 848),
    "apu-vangogh-vangogh": (3, 200),
    "gcn1-r7-240": (0, None),
    "gcn1-r9-280": (0, None),
    "gcn4-rx580": (8, 900),
    "gcn5-vega56": (8, 852),
    "rdna1-rx5500xt": (3, 0),
    "rdna1-rx5700xt": (2, None),  # no level marked at all
    "rdna2-rx6600": (3, 2605),
    "rdna2-rx6600xt": (2, 0),  # both levels marked, both 0Mhz
    "rdna2-rx6900xt": (2, 500),  # 4096-byte NUL padding
    "rdna2-rx6950xt": (2, 0),  # no final newline
    "rdna3-rx7600s": (3, 0),
    "rdna3-rx7700s": (3, 0),
    "rdna3-rx7800xt-amdref": (3, 0),
    "rdna3-rx7800xt-powercolor": (3, 77),
    "rdna3-rx7900xtx-nitro-e471": (3, 31),  # fake middle level carries the live clock
    "rdna4-rx9070": (3, 789),
    "rdna4-rx9070xt-powercolor-mar2025": (3, 0),
    "rdna4-rx9070xt-powercolor-may2025": (3, 16),
}
DPM_MCLK = {
    "apu-phoenix-phoenix-15bf": (4, 400),
    "apu-strixpoint-strixpoint-150e": (3, None),
    "apu-vangogh-vangogh": (4, 687),
    "gcn1-r7-240": (0, None),
    "gcn1-r9-280": (0, None),
    "gcn4-rx580": (3, 1750),
    "gcn5-vega56": (4, 167),
    "rdna1-rx5500xt": (4, 875),
    "rdna1-rx5700xt": (4, 875),
    "rdna2-rx6600": (4, 96),
    "rdna2-rx6600xt": (4, 96),
    "rdna2-rx6900xt": (4, 1000),
    "rdna3-rx7600s": (4, 96),
    "rdna3-rx7700s": (4, 96),
    "rdna3-rx7800xt-amdref": (4, 96),
    "rdna3-rx7800xt-powercolor": (4, 456),
    "rdna3-rx7900xtx-nitro-e471": (4, 1249),
    "rdna4-rx9070": (6, 1124),
    "rdna4-rx9070xt-powercolor-mar2025": (6, 96),
    "rdna4-rx9070xt-powercolor-may2025": (6, 1258),
}


@pytest.mark.parametrize("clk, table", [("sclk", DPM_SCLK), ("mclk", DPM_MCLK)])
def test_dpm_clock_tables(amdgpu_ref, manifest, clk, table):
    dumps = {f"{e['gen']}-{e['model']}" for e in manifest if e["fname"] == f"pp_dpm_{clk}"}
    assert dumps == set(table)
    for dump, (n, mhz) in table.items():
        t = f.parse_dpm((amdgpu_ref / f"{dump}-pp_dpm_{clk}.txt").read_bytes())
        assert (len(t.levels), t.current_mhz) == (n, mhz), dump


def test_dpm_level_details(amdgpu_ref):
    t = f.parse_dpm((amdgpu_ref / "gcn4-rx580-pp_dpm_sclk.txt").read_bytes())
    assert [lv.mhz for lv in t.levels] == [300, 600, 900, 1145, 1215, 1257, 1300, 1366]
    assert [lv.index for lv in t.active] == [2]
    vg = f.parse_dpm((amdgpu_ref / "apu-vangogh-vangogh-pp_dpm_mclk.txt").read_bytes())
    assert [lv.index for lv in vg.active] == [2, 3]


PCIE = {  # dump: [(GT/s, width, LCLK MHz, active)]
    "gcn4-rx580": [(2.5, 8, None, False), (8.0, 16, None, True)],
    "gcn5-vega56": [(8.0, 16, None, True), (8.0, 16, None, True)],
    "rdna1-rx5500xt": [(2.5, 8, 81, False), (8.0, 8, 619, True)],
    "rdna2-rx6900xt": [(2.5, 1, 310, False), (16.0, 16, 619, True)],
    "rdna3-rx7600s": [(2.5, 1, 81, False), (16.0, 8, 306, True), (16.0, 8, 306, True)],
    "rdna3-rx7700s": [(2.5, 1, 81, False), (16.0, 8, 306, False), (16.0, 8, 306, False)],
    "rdna3-rx7900xtx-nitro-e471": [(16.0, 16, 78, True), (16.0, 16, 156, True), (16.0, 16, 623, True)],
    "rdna4-rx9070": [(2.5, 16, 250, False), (16.0, 16, 1143, True)],
    "apu-phoenix-phoenix-15bf": [],  # file is "\n"
}


@pytest.mark.parametrize("dump", sorted(PCIE))
def test_dpm_pcie(amdgpu_ref, dump):
    t = f.parse_dpm((amdgpu_ref / f"{dump}-pp_dpm_pcie.txt").read_bytes())
    assert [(lv.gts, lv.width, lv.mhz, lv.active) for lv in t.levels] == PCIE[dump]


PROFILES = {  # dump: (layout, active index, active name, number of profiles)
    "apu-renoir-r7-4800h-igpu": ("list", 3, "VIDEO", 5),
    "apu-vangogh-vangogh": ("list", None, None, 7),
    "gcn4-rx580": ("smu7", 1, "3D_FULL_SCREEN", 7),
    "gcn5-vega56": ("vega10", 0, "BOOTUP_DEFAULT", 7),
    "rdna1-rx5500xt": ("smu11", 5, "COMPUTE", 7),
    "rdna1-rx5700xt": ("smu11", 6, "CUSTOM", 7),
    "rdna2-rx6600": ("smu11", 1, "3D_FULL_SCREEN", 7),
    "rdna2-rx6600xt": ("smu11", 0, "BOOTUP_DEFAULT", 7),
    "rdna2-rx6900xt": ("smu11", 0, "BOOTUP_DEFAULT", 7),
    # "%d %-14s%s" with "* " after the active name: "4 VR            * 5 COMPUTE" is VR.
    "rdna3-rx7600s": ("transposed", 4, "VR", 8),
    "rdna3-rx7700s": ("transposed", 0, "BOOTUP_DEFAULT", 8),
    "rdna3-rx7800xt-amdref": ("smu11", 0, "BOOTUP_DEFAULT", 8),
    "rdna3-rx7800xt-powercolor": ("smu11", 5, "COMPUTE", 8),
    "rdna3-rx7900xtx-nitro-e471": ("smu11", 0, "BOOTUP_DEFAULT", 8),
    "rdna4-rx9070": ("smu11", 1, "3D_FULL_SCREEN", 8),
    "rdna4-rx9070xt-powercolor-mar2025": ("smu11", 1, "3D_FULL_SCREEN", 8),
    "rdna4-rx9070xt-powercolor-may2025": ("smu11", 0, "BOOTUP_DEFAULT", 8),
}


def test_power_profiles(amdgpu_ref, manifest):
    assert {f"{e['gen']}-{e['model']}" for e in manifest if e["fname"] == "pp_power_profile_mode"} == set(PROFILES)
    for dump, want in PROFILES.items():
        p = f.parse_power_profile_mode((amdgpu_ref / f"{dump}-pp_power_profile_mode.txt").read_bytes())
        assert (p.layout, p.active_index, p.active, len(p.profiles)) == want, dump
        assert p.profiles[0][1] in ("BOOTUP_DEFAULT", "3D_FULL_SCREEN")


FAN_CURVES = {
    "rdna3-rx7800xt-amdref": ([(0, 0)] * 5, (25, 100), (20, 100)),
    "rdna3-rx7800xt-powercolor": ([(0, 0)] * 5, (25, 100), (35, 100)),
    "rdna3-rx7900xtx-nitro-e471": ([(0, 0)] * 5, (25, 100), (15, 100)),
    "rdna4-rx9070": ([(40, 25), (50, 40), (60, 60), (70, 80), (80, 100)], (25, 100), (15, 100)),
    "rdna4-rx9070xt-powercolor-mar2025": ([(0, 0)] * 5, (25, 100), (30, 100)),
    "rdna4-rx9070xt-powercolor-may2025": ([(0, 0)] * 5, (25, 100), (30, 100)),
}


def test_fan_curves(amdgpu_ref):
    for dump, (points, temp, speed) in FAN_CURVES.items():
        c = f.parse_fan_curve((amdgpu_ref / f"{dump}-gpu_od-fan_ctrl-fan_curve.txt").read_bytes())
        assert (list(c.points), c.temp_range, c.speed_range) == (points, temp, speed), dump


UEVENT = {  # dump: (PCI_ID, PCI_SLOT_NAME, DRIVER)
    "apu-phoenix-phoenix-15bf": ("1002:15BF", "0000:64:00.0", "amdgpu"),
    "apu-strixpoint-strixpoint-150e": ("1002:150E", "0000:c1:00.0", "amdgpu"),
    "apu-vangogh-vangogh": ("1002:163F", "0000:04:00.0", "amdgpu"),
    "gcn1-hd7870-radeon": ("1002:6818", "0000:01:00.0", "radeon"),
    "gcn1-r7-240": ("1002:6617", "0000:01:00.0", "amdgpu"),
    "gcn1-r9-280": ("1002:679A", "0000:01:00.0", "amdgpu"),
    "gcn4-rx580": ("1002:67DF", "0000:09:00.0", "amdgpu"),
    "gcn5-vega56": ("1002:687F", "0000:0b:00.0", "amdgpu"),
    "rdna1-rx5500xt": ("1002:7340", "0000:04:00.0", "amdgpu"),
    "rdna1-rx5700xt": ("1002:731F", "0000:28:00.0", "amdgpu"),
    "rdna2-rx6600": ("1002:73FF", "0000:12:00.0", "amdgpu"),
    "rdna2-rx6600xt": ("1002:73FF", "0000:0b:00.0", "amdgpu"),
    "rdna2-rx6900xt": ("1002:73BF", "0000:0c:00.0", "amdgpu"),
    "rdna2-rx6950xt": (None, None, "amdgpu"),  # the capture holds only DRIVER=, no newline
    "rdna3-rx7600s": ("1002:7480", "0000:03:00.0", "amdgpu"),
    "rdna3-rx7700s": ("1002:7480", "0000:03:00.0", "amdgpu"),
    "rdna3-rx7800xt-amdref": ("1002:747E", "0000:2f:00.0", "amdgpu"),
    "rdna3-rx7800xt-powercolor": ("1002:747E", "0000:03:00.0", "amdgpu"),
    "rdna3-rx7900xtx-nitro-e471": ("1002:744C", "0000:03:00.0", "amdgpu"),
    "rdna4-rx9070": ("1002:7550", "0000:03:00.0", "amdgpu"),
    "rdna4-rx9070xt-powercolor-mar2025": ("1002:7550", "0000:09:00.0", "amdgpu"),
    "rdna4-rx9070xt-powercolor-may2025": ("1002:7550", "0000:0f:00.0", "amdgpu"),
}


def test_uevents(amdgpu_ref, manifest):
    assert {f"{e['gen']}-{e['model']}" for e in manifest if e["fname"] == "uevent"} == set(UEVENT)
    for dump, want in UEVENT.items():
        u = f.parse_uevent((amdgpu_ref / f"{dump}-uevent.txt").read_bytes())
        assert (u.get("PCI_ID"), u.get("PCI_SLOT_NAME"), u["DRIVER"]) == want, dump
    u = f.parse_uevent((amdgpu_ref / "rdna3-rx7900xtx-nitro-e471-uevent.txt").read_bytes())
    assert u["PCI_SUBSYS_ID"] == "1DA2:E471" and u["PCI_CLASS"] == "30000"


LINK_GTS = {
    "apu-phoenix-phoenix-15bf": (16, 16), "apu-strixpoint-strixpoint-150e": (16, 16),
    "gcn1-r7-240": (5, 8), "gcn4-rx580": (8, 8), "gcn5-vega56": (8, 8), "rdna2-rx6900xt": (16, 16),
    "apu-vangogh-vangogh": (8, None), "gcn1-hd7870-radeon": (8, None), "gcn1-r9-280": (5, None),
    "rdna1-rx5500xt": (16, None), "rdna1-rx5700xt": (16, None), "rdna2-rx6600": (16, None),
    "rdna2-rx6600xt": (16, None), "rdna3-rx7600s": (16, None), "rdna3-rx7700s": (16, None),
    "rdna3-rx7800xt-amdref": (16, None), "rdna3-rx7800xt-powercolor": (16, None),
    "rdna3-rx7900xtx-nitro-e471": (16, None), "rdna4-rx9070": (32, None),
    "rdna4-rx9070xt-powercolor-mar2025": (32, None), "rdna4-rx9070xt-powercolor-may2025": (32, None),
}


def test_link_speeds_in_transfers_per_second(amdgpu_ref):
    for dump, (cur, mx) in LINK_GTS.items():
        assert f.parse_link_speed((amdgpu_ref / f"{dump}-current_link_speed.txt").read_bytes()) == cur * 1e9, dump
        if mx is not None:
            assert f.parse_link_speed((amdgpu_ref / f"{dump}-max_link_speed.txt").read_bytes()) == mx * 1e9, dump


def test_small_text_files(amdgpu_ref, manifest):
    levels = {
        f"{e['gen']}-{e['model']}": f.parse_performance_level((amdgpu_ref / e["file"]).read_bytes())
        for e in manifest
        if e["fname"] == "power_dpm_force_performance_level"
    }
    assert {d for d, v in levels.items() if v == "manual"} == {"rdna3-rx7600s", "rdna3-rx7800xt-powercolor"}
    assert len(levels) == 13 and set(levels.values()) == {"auto", "manual"}
    vbios = lambda d: f.parse_vbios_version((amdgpu_ref / f"{d}-vbios_version.txt").read_bytes())  # noqa: E731
    assert vbios("rdna3-rx7900xtx-nitro-e471") == "113-D70401XT-N11"
    assert vbios("rdna2-rx6900xt") == "113-D4121EXT-CO1"  # NUL-padded to 4096
    assert vbios("gcn1-r9-280") == "xxx-xxx-xxx"
    assert f.parse_unique_id((amdgpu_ref / "apu-phoenix-phoenix-15bf-unique_id.txt").read_bytes()) is None
    assert f.parse_unique_id((amdgpu_ref / "rdna2-rx6900xt-unique_id.txt").read_bytes()) == "946d7e1ef9b172dd"
    busy = lambda d: f.parse_percent_ratio((amdgpu_ref / f"{d}-gpu_busy_percent.txt").read_bytes(), d)  # noqa: E731
    assert busy("rdna4-rx9070") == 0.25 and busy("gcn4-rx580") == 0.11


VRAM = {  # dump: (used, total, visible used, visible total)
    "apu-phoenix-phoenix-15bf": (1272893440, 4294967296, 1272893440, 4294967296),
    "apu-strixpoint-strixpoint-150e": (514580480, 536870912, 514580480, 536870912),
    "gcn1-r7-240": (495321088, 2147483648, 79491072, 268435456),
    "gcn4-rx580": (536870912, 4294967296, 150302720, 268435456),
    "gcn5-vega56": (16613376, 8573157376, 16613376, 268435456),
    "rdna2-rx6900xt": (668274688, 17163091968, 668274688, 17163091968),  # large BAR: vis == total
}


def test_vram(amdgpu_ref):
    for dump, want in VRAM.items():
        got = tuple(
            f.parse_bytes((amdgpu_ref / f"{dump}-mem_info_{k}.txt").read_bytes(), k)
            for k in ("vram_used", "vram_total", "vis_vram_used", "vis_vram_total")
        )
        assert got == want, dump


def test_hwmon_units_7900xtx(amdgpu_ref):
    d = "rdna3-rx7900xtx-nitro-e471-hwmon-"
    read = lambda name: parser_for(name)((amdgpu_ref / f"{d}{name}.txt").read_bytes(), name)  # noqa: E731
    assert [read(f"power1_{k}") for k in ("average", "cap", "cap_min", "cap_max", "cap_default")] == [68.0, 290.0, 261.0, 333.0, 290.0]
    assert [read(f"temp{n}_label") for n in (1, 2, 3)] == ["edge", "junction", "mem"]
    assert [read(f"temp{n}_input") for n in (1, 2, 3)] == [53.0, 61.0, 68.0]
    assert [read(f"temp{n}_emergency") for n in (1, 2, 3)] == [105.0, 115.0, 113.0]
    assert read("temp1_crit_hyst") == -273.15
    assert (read("freq1_input"), read("freq2_input")) == (31e6, 1249e6)
    assert read("in0_input") == 0.686
    assert (read("fan1_input"), read("fan1_max")) == (0.0, 3200.0)


def test_od_fan_setting_kernel_layout():
    # Not in the reference set; layout from the SMU13 kernel's fan_ctrl show functions.
    s = f.parse_od_fan_setting("OD_ACOUSTIC_LIMIT:\n2450\nOD_RANGE:\nACOUSTIC_LIMIT: 500 3000\n", "acoustic_limit_rpm_threshold")
    assert (s.name, s.value, s.range) == ("acoustic_limit", 2450, (500, 3000))
    z = f.parse_od_fan_setting("FAN_ZERO_RPM_ENABLE:\n1\nOD_RANGE:\nZERO_RPM_ENABLE: 0 1\n", "fan_zero_rpm_enable")
    assert (z.value, z.range) == (1, (0, 1))
    with pytest.raises(AmdgpuFormatError, match="fan_minimum_pwm: line 2: expected an integer"):
        f.parse_od_fan_setting("FAN_MINIMUM_PWM:\nabc\n", "fan_minimum_pwm")


@pytest.mark.parametrize(
    "parse, data, words",
    [
        (f.parse_microwatts, b"garbage\n", "expected an integer"),
        (f.parse_microwatts, b"\n", "empty (the driver printed no value)"),
        (f.parse_millicelsius, b"45000\n46000\n", "expected one value"),
        (f.parse_percent_ratio, b"140\n", "outside 0..100"),
        (f.parse_link_speed, b"Unknown\n", "expected '<n> GT/s PCIe'"),
        (f.parse_link_width, b"3\n", "not a PCIe link width"),
        (f.parse_performance_level, b"turbo\n", "unknown performance level"),
        (f.parse_dpm, b"0: 500Mhz\n1: fast *\n", "line 2: not a DPM level line"),
        (f.parse_uevent, b"DRIVER=amdgpu\nnonsense\n", "line 2: expected KEY=value"),
        (f.parse_fan_curve, b"OD_FAN_CURVE:\n0: 40C 25%\n2: 50C 40%\n", "line 3: unexpected line"),
        (f.parse_power_profile_mode, b"PROFILE_INDEX(NAME) X\n 0 BOOT*:\n 1 VR*:\n", "several profiles marked active"),
        (f.parse_rpm, b"-5\n", "negative fan speed"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_bad_content_is_rejected_naming_the_file(parse, data, words):
    path = "/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0/x"
    with pytest.raises(AmdgpuFormatError) as exc:
        parse(data, path)
    assert str(exc.value).startswith(path + ":")
    assert words in str(exc.value)


def test_parser_for_names_and_unknown_kinds():
    assert parser_for("gpu_od/fan_ctrl/acoustic_limit_rpm_threshold") is f.parse_od_fan_setting
    assert parser_for("hwmon/hwmon3/temp2_emergency") is f.parse_millicelsius
    assert parser_for("pp_dpm_fclk") is f.parse_dpm
    with pytest.raises(KeyError, match="gpu_metrics"):
        parser_for("gpu_metrics")  # binary struct: deliberately no text parser


@settings(max_examples=int(os.environ.get("GPUGUARD_FUZZ_EXAMPLES", "300")), deadline=None, database=None)
@given(
    entry=st.sampled_from(_entries() or [None]),
    cut=st.integers(min_value=0, max_value=1600),
    junk=st.binary(max_size=8),
)
def test_damaged_small_files_fail_only_with_a_format_error(amdgpu_ref, entry, cut, junk):
    # A short read or garbage never escapes as another exception type.
    raw = (amdgpu_ref / entry["file"]).read_bytes()
    data = raw[:cut] + junk + raw[cut + len(junk):]
    try:
        parser_for(attribute(entry))(data, entry["file"])
    except AmdgpuFormatError as e:
        assert str(e).startswith(entry["file"])


# A number longer than any a kernel prints (a 64-bit value is 20 digits): Python's int()
# refused it past 4300 digits with a message naming no file, and below that a float of it
# overflowed (OverflowError, not a format error).
@pytest.mark.parametrize("digits", [30, 400, 100_000])
@pytest.mark.parametrize("parse", [f.parse_hertz, f.parse_int, f.parse_microwatts, f.parse_millicelsius,
                                   f.parse_millivolts, f.parse_rpm, f.parse_bytes], ids=lambda p: p.__name__)
def test_a_number_longer_than_a_kernel_prints_is_a_format_error_naming_the_file(parse, digits):
    path = "/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0/hwmon/hwmon3/freq1_input"
    with pytest.raises(AmdgpuFormatError) as exc:
        parse(b"9" * digits + b"\n", path)
    assert str(exc.value).startswith(path + ":")
    assert f"{digits} digits" in str(exc.value)
    assert len(str(exc.value)) < 300  # the value is cut, not echoed whole


def test_the_longest_64_bit_values_still_parse():
    assert f.parse_int(b"18446744073709551615\n", "x") == 2**64 - 1
    assert f.parse_int(b"-9223372036854775808\n", "x") == -(2**63)
    assert f.parse_microwatts(b"18446744073709551615", "x") == (2**64 - 1) / 1e6
