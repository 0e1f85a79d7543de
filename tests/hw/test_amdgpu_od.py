"""pp_od_clk_voltage: every reference file parses to hand-checked settings/ranges/tables;
unseen layouts and lines are rejected with the file and line named."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.hw.amdgpu_files import AmdgpuFormatError
from gpuguard.hw.amdgpu_od import parse_od
from gpuguard.state.snapshot import OdRange

R = OdRange

NAVI1X_RANGES_5500 = {
    "sclk_min_mhz": R(800, 2200),
    "sclk_max_mhz": R(800, 2200),
    "mclk_max_mhz": R(625, 930),
    **{f"vddc_curve_sclk_mhz[{i}]": R(800, 2200) for i in range(3)},
    **{f"vddc_curve_volt_mv[{i}]": R(700, 1150) for i in range(3)},
}
NAVI1X_RANGES_5700 = {
    "sclk_min_mhz": R(800, 2150),
    "sclk_max_mhz": R(800, 2150),
    "mclk_max_mhz": R(625, 950),
    **{f"vddc_curve_sclk_mhz[{i}]": R(800, 2150) for i in range(3)},
    **{f"vddc_curve_volt_mv[{i}]": R(750, 1200) for i in range(3)},
}
RDNA3_RANGES = {
    "sclk_min_mhz": R(500, 5000),
    "sclk_max_mhz": R(500, 5000),
    "mclk_min_mhz": R(97, 1500),
    "mclk_max_mhz": R(97, 1500),
    "vddgfx_offset_mv": R(-450, 0),
}
RDNA4_RANGES = {
    "sclk_offset_mhz": R(-500, 1000),
    "mclk_min_mhz": R(97, 1500),
    "mclk_max_mhz": R(97, 1500),
    "vddgfx_offset_mv": R(-200, 0),
}

# file -> (format, settings, ranges, tables), read off the files by hand.
EXPECTED = {
    "apu-phoenix-phoenix-15bf-pp_od_clk_voltage.txt": (
        "apu",
        {"sclk_min_mhz": 800, "sclk_max_mhz": 2700},
        {"sclk_min_mhz": R(800, 2700), "sclk_max_mhz": R(800, 2700)},
        {},
    ),
    # Hand-typed ("SCLK: 800MHz 2700Mhz", single spaces): the kernel itself mixes unit
    # case and spacing, so this parses to the same values as the real Phoenix dump.
    "apu-phoenix-r7-7840u-igpu-transcribed-pp_od_clk_voltage.txt": (
        "apu",
        {"sclk_min_mhz": 800, "sclk_max_mhz": 2700},
        {"sclk_min_mhz": R(800, 2700), "sclk_max_mhz": R(800, 2700)},
        {},
    ),
    "apu-strixpoint-strixpoint-150e-pp_od_clk_voltage.txt": (
        "apu",
        {"sclk_min_mhz": 600, "sclk_max_mhz": 2900},
        {"sclk_min_mhz": R(600, 2900), "sclk_max_mhz": R(600, 2900)},
        {},
    ),
    "apu-vangogh-vangogh-b-pp_od_clk_voltage.txt": (
        "apu-cclk",
        {"sclk_min_mhz": 1600, "sclk_max_mhz": 1600, "cclk_min_mhz": 1400, "cclk_max_mhz": 3500},
        {
            "sclk_min_mhz": R(200, 1600),
            "sclk_max_mhz": R(200, 1600),
            "cclk_min_mhz": R(1400, 3500),
            "cclk_max_mhz": R(1400, 3500),
        },
        {"cclk_core": (0,)},
    ),
    "apu-vangogh-vangogh-pp_od_clk_voltage.txt": ("empty", {}, {}, {}),
    "gcn4-rx580-pp_od_clk_voltage.txt": (
        "smu7-table",
        {},
        {"sclk_level_mhz": R(300, 2000), "mclk_level_mhz": R(300, 2250), "level_vddc_mv": R(750, 1200)},
        {
            "sclk_levels": (
                (300, 750), (600, 769), (900, 912), (1145, 1125),
                (1215, 1150), (1257, 1150), (1300, 1150), (1366, 1150),
            ),
            "mclk_levels": ((300, 750), (1000, 825), (1750, 975)),
        },
    ),
    "gcn5-vega56-pp_od_clk_voltage.txt": (
        "vega10-table",
        {},
        {"sclk_level_mhz": R(852, 2400), "mclk_level_mhz": R(167, 1500), "level_vddc_mv": R(800, 1200)},
        {
            "sclk_levels": (
                (852, 800), (991, 900), (1138, 950), (1269, 1000),
                (1312, 1050), (1474, 1100), (1538, 1150), (1590, 1200),
            ),
            "mclk_levels": ((167, 800), (500, 800), (700, 900), (920, 950)),
        },
    ),
    "rdna1-rx5500xt-b-pp_od_clk_voltage.txt": (
        "navi1x-curve",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 1825, "mclk_max_mhz": 900},
        NAVI1X_RANGES_5500,
        {"vddc_curve": ((500, 710), (1162, 794), (1825, 1115))},
    ),
    "rdna1-rx5500xt-pp_od_clk_voltage.txt": (
        "navi1x-curve",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 1900, "mclk_max_mhz": 875},
        NAVI1X_RANGES_5500,
        {"vddc_curve": ((500, 736), (1200, 779), (1900, 1102))},
    ),
    "rdna1-rx5700xt-b-pp_od_clk_voltage.txt": (
        "navi1x-curve",
        {"sclk_min_mhz": 800, "sclk_max_mhz": 2100, "mclk_max_mhz": 875},
        NAVI1X_RANGES_5700,
        {"vddc_curve": ((800, 711), (1450, 801), (2100, 1191))},
    ),
    "rdna1-rx5700xt-pp_od_clk_voltage.txt": (
        "navi1x-curve",
        {"sclk_min_mhz": 1351, "sclk_max_mhz": 1900, "mclk_max_mhz": 875},
        NAVI1X_RANGES_5700,
        {"vddc_curve": ((1351, 750), (1424, 805), (1900, 1100))},
    ),
    "rdna2-rx6600-pp_od_clk_voltage.txt": (
        "navi2x",
        {"sclk_min_mhz": 2600, "sclk_max_mhz": 2700, "mclk_min_mhz": 97, "mclk_max_mhz": 925, "vddgfx_offset_mv": -100},
        {"sclk_min_mhz": R(500, 2900), "sclk_max_mhz": R(500, 2900), "mclk_min_mhz": R(674, 950), "mclk_max_mhz": R(674, 950)},
        {},
    ),
    "rdna2-rx6700xt-pp_od_clk_voltage.txt": (
        "navi2x",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 2725, "mclk_min_mhz": 97, "mclk_max_mhz": 1000, "vddgfx_offset_mv": 0},
        {"sclk_min_mhz": R(500, 2800), "sclk_max_mhz": R(500, 2800), "mclk_min_mhz": R(674, 1075), "mclk_max_mhz": R(674, 1075)},
        {},
    ),
    "rdna2-rx6800-pp_od_clk_voltage.txt": (
        "navi2x",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 2314, "mclk_min_mhz": 97, "mclk_max_mhz": 1000, "vddgfx_offset_mv": 0},
        {"sclk_min_mhz": R(500, 2600), "sclk_max_mhz": R(500, 2600), "mclk_min_mhz": R(674, 1075), "mclk_max_mhz": R(674, 1075)},
        {},
    ),
    "rdna3-rx7800xt-amdref-pp_od_clk_voltage.txt": (
        "rdna3",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 2660, "mclk_min_mhz": 97, "mclk_max_mhz": 1219, "vddgfx_offset_mv": 0},
        RDNA3_RANGES,
        {},
    ),
    "rdna3-rx7800xt-powercolor-pp_od_clk_voltage.txt": (
        "rdna3",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 2660, "mclk_min_mhz": 97, "mclk_max_mhz": 1300, "vddgfx_offset_mv": -100},
        RDNA3_RANGES,
        {},
    ),
    # Hand-typed Linux 6.6 layout (single spaces, no final newline): parses, because only
    # spacing differs from the kernel's "%7dmv %10dmv".
    "rdna3-rx7900xtx-linux66-transcribed-pp_od_clk_voltage.txt": (
        "rdna3-curve",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 3005, "mclk_min_mhz": 97, "mclk_max_mhz": 1250},
        {
            "sclk_min_mhz": R(500, 5000),
            "sclk_max_mhz": R(500, 5000),
            "mclk_min_mhz": R(97, 1500),
            "mclk_max_mhz": R(97, 1500),
            "vddc_curve_offset_mv": R(-450, 0),
        },
        {"vddc_curve_offset_mv": (0, 0, 0, 0, 0, 0)},
    ),
    "rdna3-rx7900xtx-nitro-e471-pp_od_clk_voltage.txt": (
        "rdna3",
        {"sclk_min_mhz": 500, "sclk_max_mhz": 2735, "mclk_min_mhz": 97, "mclk_max_mhz": 1250, "vddgfx_offset_mv": 0},
        RDNA3_RANGES,
        {},
    ),
    "rdna4-rx9070-pp_od_clk_voltage.txt": (
        "rdna4",
        {"sclk_offset_mhz": 0, "mclk_min_mhz": 97, "mclk_max_mhz": 1259, "vddgfx_offset_mv": 0},
        RDNA4_RANGES,
        {},
    ),
    "rdna4-rx9070xt-fixedformat-commitmsg-pp_od_clk_voltage.txt": (
        "rdna4",
        {"sclk_offset_mhz": 0, "mclk_min_mhz": 97, "mclk_max_mhz": 1259, "vddgfx_offset_mv": 0},
        RDNA4_RANGES,
        {},
    ),
    # Pre-d9d4cb224e41 kernel: "0: -500Mhz / 1: 1000Mhz" are the limits, not the setting,
    # so no sclk_offset_mhz is reported (it would be a guess).
    "rdna4-rx9070xt-powercolor-mar2025-pp_od_clk_voltage.txt": (
        "rdna4-limits",
        {"mclk_min_mhz": 97, "mclk_max_mhz": 1259, "vddgfx_offset_mv": 0},
        RDNA4_RANGES,
        {"sclk_offset_limits_mhz": (-500, 1000)},
    ),
    "rdna4-rx9070xt-powercolor-may2025-pp_od_clk_voltage.txt": (
        "rdna4",
        {"sclk_offset_mhz": 0, "mclk_min_mhz": 97, "mclk_max_mhz": 1259, "vddgfx_offset_mv": -50},
        RDNA4_RANGES,
        {},
    ),
}


def test_every_reference_od_file_has_expectations(manifest):
    files = {e["file"] for e in manifest if e["fname"] == "pp_od_clk_voltage"}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_od_file(amdgpu_ref, name):
    fmt, settings, ranges, tables = EXPECTED[name]
    od = parse_od((amdgpu_ref / name).read_bytes(), name)
    assert od.format == fmt
    assert dict(od.settings) == settings
    assert dict(od.ranges) == ranges
    assert dict(od.tables) == tables


def test_str_and_bytes_parse_alike(amdgpu_ref):
    name = "rdna3-rx7900xtx-nitro-e471-pp_od_clk_voltage.txt"
    raw = (amdgpu_ref / name).read_bytes()
    assert b"\0" in raw  # the NUL gaps are part of what is tested
    assert parse_od(raw) == parse_od(raw.decode())


RDNA3 = (
    "OD_SCLK:\n0: 500Mhz\n1: 2735Mhz\nOD_MCLK:\n0: 97Mhz\n1: 1250MHz\n"
    "OD_VDDGFX_OFFSET:\n0mV\nOD_RANGE:\nSCLK:     500Mhz       5000Mhz\n"
    "MCLK:      97Mhz       1500Mhz\nVDDGFX_OFFSET:    -450mv          0mv\n"
)


def test_navi1x_at_sign_variant():
    # Kernels 5.5-5.8 printed "%uMHz @ %umV" in OD_VDDC_CURVE.
    text = (
        "OD_SCLK:\n0: 800Mhz\n1: 2100Mhz\nOD_MCLK:\n1: 875MHz\nOD_VDDC_CURVE:\n"
        "0: 800MHz @ 711mV\n1: 1450MHz @ 801mV\n2: 2100MHz @ 1191mV\nOD_RANGE:\n"
        "SCLK:     800Mhz       2150Mhz\nMCLK:     625Mhz        950Mhz\n"
    )
    od = parse_od(text)
    assert od.format == "navi1x-curve"
    assert od.tables["vddc_curve"] == ((800, 711), (1450, 801), (2100, 1191))


def test_vddgfx_offset_is_signed():
    od = parse_od(RDNA3.replace("OD_VDDGFX_OFFSET:\n0mV", "OD_VDDGFX_OFFSET:\n-100mV"))
    assert od.settings["vddgfx_offset_mv"] == -100


@pytest.mark.parametrize(
    "text, line_no, words",
    [
        (RDNA3 + "OD_FAN_MAGIC:\n1\n", 13, "unknown section OD_FAN_MAGIC"),
        (RDNA3.replace("1: 2735Mhz", "1: 2735GHz"), 3, "OD_SCLK: expected"),
        (RDNA3.replace("1: 2735Mhz", "2: 2735Mhz"), 3, "unexpected level 2"),
        (RDNA3.replace("0mV\n", "0mV\n5mV\n", 1), 9, "expected one value"),
        (RDNA3 + "FCLK:     400Mhz       2000Mhz\n", 13, "unknown range FCLK"),
        (RDNA3 + "PPT:      0W       100W\n", 13, "expected '<NAME>: <min><unit> <max><unit>'"),
        (RDNA3.replace("-450mv          0mv", "-450Mhz 0Mhz"), 12, "must be in mv"),
        ("garbage\n" + RDNA3, 1, "before any section"),
        (RDNA3.replace("OD_SCLK:", "OD_SCLK:\nOD_SCLK:"), 2, "printed twice"),
    ],
    ids=["section", "unit", "level", "two-values", "range-name", "range-unit-word", "range-unit", "preamble", "twice"],
)
def test_unseen_lines_fail_loudly_naming_file_and_line(text, line_no, words):
    with pytest.raises(AmdgpuFormatError) as exc:
        parse_od(text, "/sys/devices/pci0000:00/0000:03:00.0/pp_od_clk_voltage")
    msg = str(exc.value)
    assert msg.startswith(f"/sys/devices/pci0000:00/0000:03:00.0/pp_od_clk_voltage: line {line_no}: ")
    assert words in msg
    assert exc.value.line_no == line_no


@pytest.mark.parametrize(
    "text, words",
    [
        ("OD_SCLK:\n0: 500Mhz\n1: 2000Mhz\nOD_MCLK:\n0: 97Mhz\n1: 1000MHz\nOD_RANGE:\nSCLK: 500Mhz 2800Mhz\n", "layout not seen before"),
        ("OD_SCLK:\n0: 500Mhz\n1: 2000Mhz\n", "no OD_RANGE"),
        ("OD_SCLK:\nOD_RANGE:\nSCLK: 500Mhz 2800Mhz\n", "section OD_SCLK is empty"),
        # An SCLK_OFFSET range belongs to RDNA4 only; on an RDNA3 layout it is unknown.
        (RDNA3 + "SCLK_OFFSET: -500Mhz 1000Mhz\n", "not part of the rdna3 layout"),
        (RDNA3.replace("OD_RANGE:", "OD_SCLK_OFFSET:\n0Mhz\nOD_RANGE:"), "OD_SCLK is not part of the rdna4 layout"),
        # Found by the damaged-file property test: a lost OD_MCLK header left a KeyError.
        (RDNA3.replace("OD_MCLK:\n0: 97Mhz\n1: 1250MHz\n", ""), "the rdna3 layout lacks section OD_MCLK"),
        ("OD_VDDC_CURVE:\n0: 1.5V\nOD_RANGE:\nSCLK: 1Mhz 2Mhz\n", "OD_VDDC_CURVE line of unknown shape"),
    ],
    ids=["minmax-without-vddgfx", "no-range", "empty-section", "foreign-range", "mixed-sclk", "missing-mclk", "curve-shape"],
)
def test_unseen_layouts_are_rejected(text, words):
    with pytest.raises(AmdgpuFormatError, match=words):
        parse_od(text, "pp_od_clk_voltage")


def test_rdna3_curve_needs_six_zones():
    text = "OD_SCLK:\n0: 500Mhz\n1: 3005Mhz\nOD_MCLK:\n0: 97Mhz\n1: 1250MHz\nOD_VDDC_CURVE:\n0: 0mv\n1: 0mv\nOD_RANGE:\nSCLK: 500Mhz 5000Mhz\n"
    with pytest.raises(AmdgpuFormatError, match="expected 6 zones"):
        parse_od(text)


def test_a_leftover_write_is_not_an_od_table():
    # LACT's rx7700s capture held only "r\n" (a write leftover): must not parse as empty.
    with pytest.raises(AmdgpuFormatError, match="line 1: line before any section"):
        parse_od(b"r\n", "pp_od_clk_voltage")


def test_nul_inside_a_line_is_whitespace_not_glue():
    # NUL gaps are whitespace: "1250MHz\0\0OD_VDDGFX_OFFSET:" on one line must not be
    # silently read as two lines or as one run-together token.
    text = RDNA3.replace("1: 1250MHz\n", "1: 1250MHz\0\0\0")
    with pytest.raises(AmdgpuFormatError, match="line 6"):
        parse_od(text)


@settings(max_examples=int(os.environ.get("GPUGUARD_FUZZ_EXAMPLES", "300")), deadline=None, database=None)
@given(
    base=st.sampled_from(sorted(EXPECTED)),
    cut=st.integers(min_value=0, max_value=2000),
    junk=st.binary(max_size=12),
)
def test_damaged_files_parse_or_fail_with_a_format_error(amdgpu_ref, base, cut, junk):
    # Truncated or corrupted output (a short read, a hung SMU) must never escape as any
    # other exception: the poller turns AmdgpuFormatError into od_error, nothing else.
    raw = (amdgpu_ref / base).read_bytes()
    data = raw[:cut] + junk + raw[cut + len(junk):]
    try:
        od = parse_od(data, base)
    except AmdgpuFormatError as e:
        assert str(e).startswith(base)
    else:
        assert od.format in {"empty", "apu", "apu-cclk", "smu7-table", "vega10-table", "navi1x-curve",
                             "navi2x", "rdna3-curve", "rdna3", "rdna4", "rdna4-limits"}
