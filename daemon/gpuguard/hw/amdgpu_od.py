"""Parser for `pp_od_clk_voltage`, every generation in reference/amdgpu, into `OdState`.

The apply path chooses its write syntax from `OdState.format`, never from the PCI id
(amdgpu-od-protocol §6), so the format must name the layout exactly:

| format         | what the card printed                                          | write syntax        |
|----------------|----------------------------------------------------------------|---------------------|
| `empty`        | only "\\n" (VanGogh outside manual mode)                        | none                |
| `apu`          | OD_SCLK 0/1, OD_RANGE SCLK (Phoenix, Strix, Renoir)            | `s 0|1 MHz`, manual |
| `apu-cclk`     | `apu` + `CCLK_RANGE in CoreN:` / range CCLK (VanGogh manual)   | + `p core 0|1 MHz`  |
| `smu7-table`   | per-level `N: <MHz>MHz <mV>mV` OD_SCLK/OD_MCLK (Polaris)       | `s|m level MHz mV`  |
| `vega10-table` | same, printed `Mhz` (vega10_hwmgr)                             | `s|m level MHz mV`  |
| `navi1x-curve` | OD_SCLK 0/1, OD_MCLK 1, 3-point OD_VDDC_CURVE (MHz, mV)        | `s`, `m 1`, `vc`    |
| `navi2x`       | OD_SCLK/OD_MCLK 0/1 + OD_VDDGFX_OFFSET, no VDDGFX range        | `s`, `m`, `vo`      |
| `rdna3-curve`  | Linux 6.6 SMU13: OD_VDDC_CURVE of six zone offsets (mV)        | `s`, `m`, `vc zone` |
| `rdna3`        | SMU13 >= 6.7: + OD_RANGE `VDDGFX_OFFSET`                        | `s`, `m`, `vo`      |
| `rdna4`        | SMU14 fixed: OD_SCLK_OFFSET is one value (`0Mhz`)              | `s <offset>`        |
| `rdna4-limits` | SMU14 before d9d4cb224e41: OD_SCLK_OFFSET printed the limits   | `s 1 <offset>`      |
|                | as levels (`0: -500Mhz / 1: 1000Mhz`); no current offset known |                     |

Setting names (`OdState.settings`, and `ranges` keyed the same way): `sclk_min_mhz`,
`sclk_max_mhz`, `mclk_min_mhz`, `mclk_max_mhz`, `sclk_offset_mhz`, `vddgfx_offset_mv`,
`cclk_min_mhz`, `cclk_max_mhz`. Tables: `vddc_curve` ((MHz, mV) per point, navi1x) with
ranges `vddc_curve_sclk_mhz[i]`/`vddc_curve_volt_mv[i]`; `vddc_curve_offset_mv` (six zone
offsets, rdna3-curve, range `vddc_curve_offset_mv`); `sclk_levels`/`mclk_levels`
((MHz, mV) per level, tables formats, ranges `sclk_level_mhz`, `mclk_level_mhz`,
`level_vddc_mv`); `sclk_offset_limits_mhz` (rdna4-limits); `cclk_core` (apu-cclk).

A section, range name or line we have not seen raises `AmdgpuFormatError` naming the
file and the line: the OD field is then absent with that reason, never guessed.
The two hand-typed "transcribed" reference files differ from kernel output only in
spacing, unit case and the final newline, all of which real kernels vary too, so they
parse (tested); a file with a value the kernel could not print is rejected.
"""
from __future__ import annotations

import re
from functools import lru_cache

from gpuguard.hw.amdgpu_files import AmdgpuFormatError, numbered_lines
from gpuguard.state.snapshot import OdRange, OdState

OD_FILE = "pp_od_clk_voltage"

_HEADER = re.compile(r"(OD_[A-Z_]+|CCLK_RANGE in Core(\d+)):\Z")
KNOWN_SECTIONS = frozenset(
    {"OD_SCLK", "OD_MCLK", "OD_VDDC_CURVE", "OD_VDDGFX_OFFSET", "OD_SCLK_OFFSET", "OD_RANGE", "OD_CCLK"}
)
# Which sections each layout prints; anything else in the file is an error.
_ALLOWED = {
    "apu": {"OD_SCLK", "OD_RANGE"},
    "apu-cclk": {"OD_SCLK", "OD_RANGE", "OD_CCLK"},
    "smu7-table": {"OD_SCLK", "OD_MCLK", "OD_RANGE"},
    "vega10-table": {"OD_SCLK", "OD_MCLK", "OD_RANGE"},
    "navi1x-curve": {"OD_SCLK", "OD_MCLK", "OD_VDDC_CURVE", "OD_RANGE"},
    "rdna3-curve": {"OD_SCLK", "OD_MCLK", "OD_VDDC_CURVE", "OD_RANGE"},
    "navi2x": {"OD_SCLK", "OD_MCLK", "OD_VDDGFX_OFFSET", "OD_RANGE"},
    "rdna3": {"OD_SCLK", "OD_MCLK", "OD_VDDGFX_OFFSET", "OD_RANGE"},
    "rdna4": {"OD_SCLK_OFFSET", "OD_MCLK", "OD_VDDGFX_OFFSET", "OD_RANGE"},
    "rdna4-limits": {"OD_SCLK_OFFSET", "OD_MCLK", "OD_VDDGFX_OFFSET", "OD_RANGE"},
}
# (range name in OD_RANGE) -> unit it must carry.
_RANGE_UNITS = {
    "SCLK": "mhz",
    "MCLK": "mhz",
    "CCLK": "mhz",
    "SCLK_OFFSET": "mhz",
    "VDDC": "mv",
    "VDDGFX_OFFSET": "mv",
    "VDDC_CURVE": "mv",
    "VDDC_CURVE_SCLK": "mhz",
    "VDDC_CURVE_VOLT": "mv",
}

# Kernel print formats, case-insensitive on units: "Mhz"/"MHz", "mV"/"mv" are both real.
_LEVEL = re.compile(r"(\d+):\s*(-?\d+)\s*MHz\Z", re.IGNORECASE)
# Navi1x kernels 5.5-5.8 printed "%uMHz @ %umV" (protocol §2), later "%uMHz %umV".
_LEVEL_MV = re.compile(r"(\d+):\s*(-?\d+)\s*MHz\s+(?:@\s*)?(-?\d+)\s*mV\Z", re.IGNORECASE)
_ZONE_MV = re.compile(r"(\d+):\s*(-?\d+)\s*mV\Z", re.IGNORECASE)
_MHZ = re.compile(r"(-?\d+)\s*MHz\Z", re.IGNORECASE)
_MV = re.compile(r"(-?\d+)\s*mV\Z", re.IGNORECASE)
_RANGE = re.compile(
    r"([A-Z_]+)(?:\[(\d+)\])?:\s*(-?\d+)\s*(MHz|mV)\s+(-?\d+)\s*(MHz|mV)\Z", re.IGNORECASE
)


class _Section:
    __slots__ = ("name", "core", "lines")

    def __init__(self, name: str, core: int | None) -> None:
        self.name = name
        self.core = core
        self.lines: list[tuple[int, str]] = []


def parse_od(data: bytes | str, file: str = OD_FILE) -> OdState:
    """Parse one `pp_od_clk_voltage` read. Raises AmdgpuFormatError (a ValueError)."""
    if isinstance(data, bytes):
        return _parse_od_cached(data, file)
    return _parse_od(data, file)


@lru_cache(maxsize=512)
def _parse_od_cached(data: bytes, file: str) -> OdState:
    # The poller reads the same bytes every cycle; OdState is immutable, so an unchanged
    # file costs a hash lookup instead of a parse (keeps a poll near the raw read cost).
    return _parse_od(data, file)


def _parse_od(data: bytes | str, file: str) -> OdState:
    sections: dict[str, _Section] = {}
    current: _Section | None = None
    for n, line in numbered_lines(data):
        h = _HEADER.match(line)
        if h:
            name = "OD_CCLK" if h.group(2) is not None else h.group(1)
            if name not in KNOWN_SECTIONS:
                raise AmdgpuFormatError(file, f"unknown section {h.group(1)}", n, line)
            if name in sections:
                raise AmdgpuFormatError(file, f"section {name} printed twice", n, line)
            current = sections[name] = _Section(name, int(h.group(2)) if h.group(2) else None)
            continue
        if current is None:
            raise AmdgpuFormatError(file, "line before any section header", n, line)
        current.lines.append((n, line))
    if not sections:
        return OdState("empty")
    for s in sections.values():
        if not s.lines:
            raise AmdgpuFormatError(file, f"section {s.name} is empty")
    fmt = _classify(sections, file)
    extra = set(sections) - _ALLOWED[fmt]
    if extra:
        first = min(extra, key=lambda k: sections[k].lines[0][0])
        n = sections[first].lines[0][0] - 1
        raise AmdgpuFormatError(file, f"section {first} is not part of the {fmt} layout", n)
    return _build(fmt, sections, file)


def _classify(sections: dict[str, _Section], file: str) -> str:
    if "OD_RANGE" not in sections:
        raise AmdgpuFormatError(file, "no OD_RANGE section")
    if "OD_SCLK_OFFSET" in sections:
        lines = sections["OD_SCLK_OFFSET"].lines
        # SMU14 before upstream d9d4cb224e41 printed the firmware limits as two levels
        # (protocol §2): two numbered lines => old syntax, and no current offset known.
        return "rdna4-limits" if all(_LEVEL.match(ln) for _, ln in lines) and len(lines) == 2 else "rdna4"
    if "OD_VDDC_CURVE" in sections:
        first_n, first = sections["OD_VDDC_CURVE"].lines[0]
        if _LEVEL_MV.match(first):
            return "navi1x-curve"
        if _ZONE_MV.match(first):
            return "rdna3-curve"
        raise AmdgpuFormatError(file, "OD_VDDC_CURVE line of unknown shape", first_n, first)
    if "OD_SCLK" not in sections:
        raise AmdgpuFormatError(file, "neither OD_SCLK nor OD_SCLK_OFFSET present")
    first_n, first = sections["OD_SCLK"].lines[0]
    if _LEVEL_MV.match(first):
        # smu7_hwmgr prints "%uMHz %umV", vega10_hwmgr "%uMhz %umV": same write syntax.
        return "smu7-table" if "MHz" in first else "vega10-table"
    ranges = {r.split(":", 1)[0].strip() for _, r in sections["OD_RANGE"].lines}
    if "VDDGFX_OFFSET" in ranges:
        return "rdna3"
    if "OD_VDDGFX_OFFSET" in sections:
        return "navi2x"
    if "OD_MCLK" in sections:
        raise AmdgpuFormatError(
            file, "OD_SCLK/OD_MCLK without OD_VDDGFX_OFFSET or a curve: a layout not seen before"
        )
    if "OD_CCLK" in sections or any(r.startswith("CCLK:") for _, r in sections["OD_RANGE"].lines):
        return "apu-cclk"
    return "apu"


def _levels(sec: _Section, file: str, pattern: re.Pattern, what: str) -> list[tuple]:
    out = []
    for n, line in sec.lines:
        m = pattern.match(line)
        if not m:
            raise AmdgpuFormatError(file, f"{sec.name}: expected {what}", n, line)
        out.append((n, line, tuple(int(g) for g in m.groups())))
    return out


def _min_max(sec: _Section, file: str, prefix: str, allowed_idx: tuple[int, ...]) -> dict[str, int]:
    """`0: <MHz>` / `1: <MHz>` -> {prefix_min_mhz, prefix_max_mhz}."""
    out: dict[str, int] = {}
    for n, line, (idx, mhz) in _levels(sec, file, _LEVEL, "'N: <MHz>Mhz'"):
        key = f"{prefix}_{'min' if idx == 0 else 'max'}_mhz"
        if idx not in allowed_idx or key in out:
            raise AmdgpuFormatError(file, f"{sec.name}: unexpected level {idx}", n, line)
        out[key] = mhz
    if len(out) != len(allowed_idx):
        raise AmdgpuFormatError(file, f"{sec.name}: expected levels {allowed_idx}")
    return out


def _single(sec: _Section, file: str, pattern: re.Pattern, what: str) -> int:
    if len(sec.lines) != 1:
        n, line = sec.lines[1]
        raise AmdgpuFormatError(file, f"{sec.name}: expected one value", n, line)
    n, line = sec.lines[0]
    m = pattern.match(line)
    if not m:
        raise AmdgpuFormatError(file, f"{sec.name}: expected {what}", n, line)
    return int(m.group(1))


def _table(sec: _Section, file: str, pattern: re.Pattern, what: str) -> tuple:
    rows = _levels(sec, file, pattern, what)
    for i, (n, line, groups) in enumerate(rows):
        if groups[0] != i:
            raise AmdgpuFormatError(file, f"{sec.name}: levels out of order", n, line)
    return tuple(g[1:] if len(g) > 2 else g[1] for _, _, g in rows)


class _NeedSections(dict):
    """Sections by name; a required one that is absent raises a format error (not a
    KeyError) when the builder reaches it, so line errors earlier in the file win."""

    def __init__(self, sections: dict[str, _Section], fmt: str, file: str) -> None:
        super().__init__(sections)
        self.fmt, self.file = fmt, file

    def __missing__(self, name: str) -> _Section:
        raise AmdgpuFormatError(self.file, f"the {self.fmt} layout lacks section {name}")


def _build(fmt: str, sections: dict[str, _Section], file: str) -> OdState:
    settings: dict[str, int] = {}
    tables: dict[str, tuple] = {}
    sections = _NeedSections(sections, fmt, file)
    sec = sections.get
    if fmt in ("apu", "apu-cclk", "navi2x", "rdna3", "navi1x-curve", "rdna3-curve"):
        settings.update(_min_max(sections["OD_SCLK"], file, "sclk", (0, 1)))
    if fmt in ("navi2x", "rdna3", "rdna3-curve", "rdna4", "rdna4-limits"):
        settings.update(_min_max(sections["OD_MCLK"], file, "mclk", (0, 1)))
    if fmt == "navi1x-curve":
        # Navi1x only lets the MCLK maximum be set (`m 1`), so only level 1 is printed.
        settings.update(_min_max(sections["OD_MCLK"], file, "mclk", (1,)))
        tables["vddc_curve"] = _table(sections["OD_VDDC_CURVE"], file, _LEVEL_MV, "'N: <MHz>MHz <mV>mV'")
    if fmt == "rdna3-curve":
        zones = _table(sections["OD_VDDC_CURVE"], file, _ZONE_MV, "'N: <mV>mv'")
        if len(zones) != 6:
            raise AmdgpuFormatError(file, f"OD_VDDC_CURVE: expected 6 zones, read {len(zones)}")
        tables["vddc_curve_offset_mv"] = zones
    if fmt in ("navi2x", "rdna3", "rdna4", "rdna4-limits"):
        settings["vddgfx_offset_mv"] = _single(sections["OD_VDDGFX_OFFSET"], file, _MV, "'<mV>mV'")
    if fmt == "rdna4":
        settings["sclk_offset_mhz"] = _single(sections["OD_SCLK_OFFSET"], file, _MHZ, "'<offset>Mhz'")
    if fmt == "rdna4-limits":
        lv = _table(sections["OD_SCLK_OFFSET"], file, _LEVEL, "'N: <MHz>Mhz'")
        tables["sclk_offset_limits_mhz"] = lv
    if fmt in ("smu7-table", "vega10-table"):
        tables["sclk_levels"] = _table(sections["OD_SCLK"], file, _LEVEL_MV, "'N: <MHz>MHz <mV>mV'")
        if sec("OD_MCLK"):
            tables["mclk_levels"] = _table(sections["OD_MCLK"], file, _LEVEL_MV, "'N: <MHz>MHz <mV>mV'")
    if fmt == "apu-cclk" and sec("OD_CCLK"):
        settings.update(_min_max(sections["OD_CCLK"], file, "cclk", (0, 1)))
        if sections["OD_CCLK"].core is not None:
            tables["cclk_core"] = (sections["OD_CCLK"].core,)
    ranges = _ranges(fmt, sections["OD_RANGE"], settings, tables, file)
    return OdState(fmt, settings, ranges, tables)


def _ranges(fmt: str, sec: _Section, settings: dict, tables: dict, file: str) -> dict[str, OdRange]:
    table_fmt = fmt in ("smu7-table", "vega10-table")
    out: dict[str, OdRange] = {}
    for n, line in sec.lines:
        m = _RANGE.match(line)
        if not m:
            raise AmdgpuFormatError(file, "OD_RANGE: expected '<NAME>: <min><unit> <max><unit>'", n, line)
        name, index, lo, lo_unit, hi, hi_unit = m.groups()
        unit = _RANGE_UNITS.get(name)
        if unit is None:
            raise AmdgpuFormatError(file, f"OD_RANGE: unknown range {name}", n, line)
        if lo_unit.lower() != unit or hi_unit.lower() != unit:
            raise AmdgpuFormatError(file, f"OD_RANGE: {name} must be in {unit}", n, line)
        if (index is not None) != name.startswith("VDDC_CURVE_"):
            raise AmdgpuFormatError(file, f"OD_RANGE: {name} index mismatch", n, line)
        rng = OdRange(int(lo), int(hi))
        if rng.min > rng.max:
            raise AmdgpuFormatError(file, f"OD_RANGE: {name} min above max", n, line)
        keys = _range_keys(fmt, name, index, settings, tables, table_fmt)
        if not keys:
            raise AmdgpuFormatError(file, f"OD_RANGE: {name} is not part of the {fmt} layout", n, line)
        for key in keys:
            if key in out:
                raise AmdgpuFormatError(file, f"OD_RANGE: {name} printed twice", n, line)
            out[key] = rng
    return out


def _range_keys(fmt: str, name: str, index: str | None, settings: dict, tables: dict, table_fmt: bool) -> list[str]:
    if table_fmt:
        return {"SCLK": ["sclk_level_mhz"], "MCLK": ["mclk_level_mhz"], "VDDC": ["level_vddc_mv"]}.get(name, [])
    if name in ("SCLK", "MCLK", "CCLK"):
        # One OD_RANGE line bounds both knobs (protocol §2: min is the Fmin knob's limit,
        # max the Fmax knob's); only the knobs this layout prints are keyed.
        p = name.lower()
        keys = [f"{p}_min_mhz", f"{p}_max_mhz"]
        if name == "CCLK" and fmt == "apu-cclk" and "cclk_min_mhz" not in settings:
            return keys  # VanGogh may print the CCLK range without the core section
        return [k for k in keys if k in settings]
    if name == "SCLK_OFFSET":
        return ["sclk_offset_mhz"] if fmt in ("rdna4", "rdna4-limits") else []
    if name == "VDDGFX_OFFSET":
        return ["vddgfx_offset_mv"] if "vddgfx_offset_mv" in settings else []
    if name == "VDDC_CURVE":
        return ["vddc_curve_offset_mv"] if "vddc_curve_offset_mv" in tables else []
    if name in ("VDDC_CURVE_SCLK", "VDDC_CURVE_VOLT") and "vddc_curve" in tables:
        if int(index) >= len(tables["vddc_curve"]):
            return []
        unit = "mhz" if name == "VDDC_CURVE_SCLK" else "mv"
        return [f"{name.lower()}_{unit}[{index}]"]
    return []
