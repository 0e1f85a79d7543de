"""Parsers for the small amdgpu sysfs files: pure functions, bytes or str in, typed values out.

Owns the byte-level knowledge of each file kind under a card's `device/` folder and its
amdgpu `hwmon/` folder (`pp_dpm_*`, hwmon µW/m°C/mV/Hz values, `uevent`, link speed,
busy %, `mem_info_*`, performance level, `vbios_version`, `pp_power_profile_mode`,
`gpu_od/fan_ctrl/*`). `pp_od_clk_voltage` has its own module (`amdgpu_od`).

Real output has NUL runs and 4096-byte NUL padding, trailing spaces, `Mhz`/`MHz`, several
`*` markers, files that are only "\\n" and files without a final newline
(reference/amdgpu/SOURCES.md). NUL is treated as whitespace. Anything else that does not
match a known layout raises `AmdgpuFormatError` (a ValueError) naming the file and the
line: a value we cannot read is absent with a reason, never a guess and never a zero.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


class AmdgpuFormatError(ValueError):
    """A file's content does not match any layout we know. The message names the file,
    the 1-based line (0 when the whole file is at fault) and what was read."""

    def __init__(self, file: str, reason: str, line_no: int = 0, line: str | None = None) -> None:
        self.file = file
        self.reason = reason
        self.line_no = line_no
        self.line = line
        where = f"{file}: line {line_no}" if line_no else file
        text = f"{where}: {reason}"
        if line is not None:
            text += f": {line.strip()[:80]!r}"
        super().__init__(text)


def sysfs_text(data: bytes | str) -> str:
    """Decoded text with NUL bytes as spaces (NUL runs and padding are real kernel and
    capture output, SOURCES.md) and line structure kept, so line numbers stay true."""
    if isinstance(data, bytes):
        i = data.find(b"\0")
        if i >= 0:
            # Pure padding (the common case) is cut with one compare: bytes.rstrip(b"\0")
            # costs ~8 µs on a 4096-byte page, more than the read itself.
            if data.endswith(bytes(len(data) - i)):
                data = data[:i]
            else:
                data = data.replace(b"\0", b" ")
        return data.decode("utf-8", "replace")
    return data.replace("\0", " ") if "\0" in data else data


def numbered_lines(data: bytes | str) -> list[tuple[int, str]]:
    """(line number, line without surrounding whitespace) for every non-blank line."""
    out = []
    for n, line in enumerate(sysfs_text(data).split("\n"), 1):
        s = line.strip()
        if s:
            out.append((n, s))
    return out


def _value_text(data: bytes | str, file: str) -> str:
    text = sysfs_text(data).strip()
    if not text:
        # A show() that failed its query prints an empty line (amdgpu-od-protocol §4).
        raise AmdgpuFormatError(file, "empty (the driver printed no value)")
    if "\n" in text:
        raise AmdgpuFormatError(file, "expected one value, read several lines", 0, text)
    return text


_INT = re.compile(r"-?\d+\Z")
# The most digits a kernel attribute prints: a 64-bit value has 20. More is not a reading:
# int() refuses one only past 4300 digits, with a message that names no file, and a float
# of a shorter one overflows. The fast paths take no more than that many bytes.
_DIGITS = 20


def parse_int(data: bytes | str, file: str) -> int:
    """A plain decimal integer attribute (hwmon values, `mem_info_*`, link width)."""
    if len(data) <= _DIGITS:
        try:
            # Fast path for the poll loop: int() takes b"68000000\n" as is. It also takes
            # "+5" and "1_0", which no kernel prints; anything else goes the careful way.
            return int(data)
        except ValueError:
            pass
    text = _value_text(data, file)
    if not _INT.match(text):
        raise AmdgpuFormatError(file, "expected an integer", 0, text)
    digits = len(text) - text.startswith("-")
    if digits > _DIGITS:
        raise AmdgpuFormatError(file, f"a number of {digits} digits: longer than any value the kernel prints "
                                "(64 bits)", 0, text)
    return int(text)


# hwmon sysfs-interface units -> base units.
def parse_microwatts(data: bytes | str, file: str) -> float:
    """`power1_average`/`_input`/`_cap*` (µW) -> watts."""
    if len(data) <= _DIGITS:
        try:
            return int(data) / 1e6  # fast path, see parse_int
        except ValueError:
            pass
    return parse_int(data, file) / 1e6


def parse_millicelsius(data: bytes | str, file: str) -> float:
    """`tempN_input`/`_crit`/`_emergency` (m°C) -> °C."""
    if len(data) <= _DIGITS:
        try:
            return int(data) / 1000.0  # fast path, see parse_int
        except ValueError:
            pass
    return parse_int(data, file) / 1000.0


def parse_millivolts(data: bytes | str, file: str) -> float:
    """`inN_input` (mV) -> volts."""
    if len(data) <= _DIGITS:
        try:
            return int(data) / 1000.0  # fast path, see parse_int
        except ValueError:
            pass
    return parse_int(data, file) / 1000.0


def parse_hertz(data: bytes | str, file: str) -> float:
    """`freqN_input` (Hz) -> Hz."""
    return float(parse_int(data, file))


def parse_rpm(data: bytes | str, file: str) -> float:
    """`fan1_input`/`_min`/`_max` (RPM)."""
    value = parse_int(data, file)
    if value < 0:
        raise AmdgpuFormatError(file, "negative fan speed", 0, str(value))
    return float(value)


def parse_bytes(data: bytes | str, file: str) -> int:
    """`mem_info_vram_total`/`_used`, `mem_info_vis_vram_*` (bytes)."""
    value = parse_int(data, file)
    if value < 0:
        raise AmdgpuFormatError(file, "negative byte count", 0, str(value))
    return value


def parse_percent_ratio(data: bytes | str, file: str) -> float:
    """`gpu_busy_percent`/`mem_busy_percent` (0..100) -> ratio 0..1."""
    value = parse_int(data, file)
    if not 0 <= value <= 100:
        raise AmdgpuFormatError(file, "percentage outside 0..100", 0, str(value))
    return value / 100.0


def parse_label(data: bytes | str, file: str) -> str:
    """A hwmon `*_label` or `name` (`edge`, `junction`, `PPT`, `sclk`, `amdgpu`)."""
    text = _value_text(data, file)
    if any(c.isspace() for c in text):
        raise AmdgpuFormatError(file, "a label is one word", 0, text)
    return text


def parse_uevent(data: bytes | str, file: str = "uevent") -> dict[str, str]:
    """`KEY=value` lines (`PCI_ID=1002:744C`, `PCI_SLOT_NAME=0000:03:00.0`, ...)."""
    out: dict[str, str] = {}
    for n, line in numbered_lines(data):
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z0-9_]+", key):
            raise AmdgpuFormatError(file, "expected KEY=value", n, line)
        out[key] = value
    return out


_LINK_SPEED = re.compile(r"(\d+(?:\.\d+)?) GT/s(?: PCIe)?\Z")


def parse_link_speed(data: bytes | str, file: str = "current_link_speed") -> float:
    """`current_link_speed`/`max_link_speed` ("16.0 GT/s PCIe") -> transfers per second."""
    text = _value_text(data, file)
    m = _LINK_SPEED.match(text)
    if not m:
        # The PCI core prints "Unknown" for a speed it cannot name: no number to report.
        raise AmdgpuFormatError(file, "expected '<n> GT/s PCIe'", 0, text)
    return float(m.group(1)) * 1e9


def parse_link_width(data: bytes | str, file: str = "current_link_width") -> int:
    """`current_link_width`/`max_link_width` ("16") -> lanes."""
    value = parse_int(data, file)
    if value not in (1, 2, 4, 8, 12, 16, 32):
        raise AmdgpuFormatError(file, "not a PCIe link width", 0, str(value))
    return value


# amdgpu_set_power_dpm_force_performance_level accepts exactly these (protocol §3).
PERFORMANCE_LEVELS = frozenset(
    {
        "auto",
        "low",
        "high",
        "manual",
        "profile_exit",
        "profile_standard",
        "profile_min_sclk",
        "profile_min_mclk",
        "profile_peak",
        "perf_determinism",
    }
)


def parse_performance_level(data: bytes | str, file: str = "power_dpm_force_performance_level") -> str:
    text = _value_text(data, file)
    if text not in PERFORMANCE_LEVELS:
        raise AmdgpuFormatError(file, "unknown performance level", 0, text)
    return text


def parse_vbios_version(data: bytes | str, file: str = "vbios_version") -> str:
    """The VBIOS part number (`113-D70401XT-N11`; `xxx-xxx-xxx` on some boards)."""
    return _value_text(data, file)


def parse_unique_id(data: bytes | str, file: str = "unique_id") -> str | None:
    """The chip's serial (hex); empty on parts that do not expose one (Phoenix)."""
    text = sysfs_text(data).strip()
    if not text:
        return None
    if not re.fullmatch(r"[0-9a-fA-F]+", text):
        raise AmdgpuFormatError(file, "expected a hex id", 0, text)
    return text.lower()


# ---------------------------------------------------------------------------- pp_dpm_*


@dataclass(frozen=True)
class DpmLevel:
    """One line of a `pp_dpm_*` file. `index` is None for the deep-sleep `S:` pseudo-level.
    Clock files fill `mhz`; `pp_dpm_pcie` fills `gts`/`width` (and `mhz`, the LCLK, when
    the ASIC prints it)."""

    index: int | None
    mhz: int | None
    active: bool
    gts: float | None = None
    width: int | None = None


@dataclass(frozen=True)
class DpmTable:
    levels: tuple[DpmLevel, ...]

    @property
    def active(self) -> tuple[DpmLevel, ...]:
        """Levels marked `*`; several at once is real (RDNA3 `pp_dpm_pcie`, SOURCES.md)."""
        return tuple(lv for lv in self.levels if lv.active)

    @property
    def current_mhz(self) -> int | None:
        """The clock of the `*` level (the highest when several are marked); None if
        nothing is marked. On fine-grained clocks the fake middle level carries the live
        clock (`1: 31Mhz *`), so this is the value the card runs at."""
        marked = [lv.mhz for lv in self.levels if lv.active and lv.mhz is not None]
        return max(marked) if marked else None


_DPM_CLOCK = re.compile(r"(\d+|S):\s*(\d+)\s*mhz\s*(\*)?\Z", re.IGNORECASE)
_DPM_PCIE = re.compile(
    r"(\d+):\s*(\d+(?:\.\d+)?)GT/s,\s*x(\d+)(?:\s+(\d+)\s*mhz)?\s*(\*)?\Z", re.IGNORECASE
)


def parse_dpm(data: bytes | str, file: str = "pp_dpm_sclk") -> DpmTable:
    """`pp_dpm_sclk|mclk|socclk|fclk|dcefclk|vclk|dclk|pcie`. A file that is only "\\n"
    (GCN1, APU `pp_dpm_pcie`) is an empty table."""
    levels = []
    for n, line in numbered_lines(data):
        m = _DPM_CLOCK.match(line)
        if m:
            idx = None if m.group(1) == "S" else int(m.group(1))
            levels.append(DpmLevel(idx, int(m.group(2)), bool(m.group(3))))
            continue
        m = _DPM_PCIE.match(line)
        if m:
            lclk = int(m.group(4)) if m.group(4) else None
            levels.append(
                DpmLevel(int(m.group(1)), lclk, bool(m.group(5)), float(m.group(2)), int(m.group(3)))
            )
            continue
        raise AmdgpuFormatError(file, "not a DPM level line ('N: <clock>Mhz [*]')", n, line)
    return DpmTable(tuple(levels))


# ---------------------------------------------------------------- pp_power_profile_mode


@dataclass(frozen=True)
class PowerProfiles:
    """`pp_power_profile_mode`: the profiles the card lists and the one marked active."""

    layout: str  # list (APU), smu7, vega10, smu11 (SMU11/13/14 dGPU), transposed (SMU 13.0.7)
    profiles: tuple[tuple[int, str], ...]
    active_index: int | None
    active: str | None


_PROFILE_ROW = re.compile(r"(\d+)\s+([A-Z0-9_]+)\s*(\*)?\s*:")
_PROFILE_LIST = re.compile(r"(\d+)\s+([A-Z0-9_]+)\s*(\*)?\Z")
_PROFILE_SUBROW = re.compile(r"\d+\(\s*[A-Z0-9_]+\)(\s+-?\d+)+\Z")
_PROFILE_HEADER_ITEM = re.compile(r"(\d+) ([A-Z0-9_]+)\s*(\*)?")
_PROFILE_PARAM_ROW = re.compile(r"[A-Za-z0-9_]+(\s+-?\d+)+\Z")


def parse_power_profile_mode(data: bytes | str, file: str = "pp_power_profile_mode") -> PowerProfiles:
    lines = numbered_lines(data)
    if not lines:
        raise AmdgpuFormatError(file, "empty")
    profiles: list[tuple[int, str]] = []
    active: list[int] = []
    first_n, first = lines[0]
    if first.startswith("0 ") and re.search(r"\d+ [A-Z0-9_]+\s*\*?\s+\d+ [A-Z]", first):
        # SMU 13.0.7 (Navi33) prints all profiles on line 1 as "%d %-14s%s" with "* " after
        # the active one: "4 VR            * 5 COMPUTE" means VR is active, not COMPUTE.
        layout = "transposed"
        for m in _PROFILE_HEADER_ITEM.finditer(first):
            profiles.append((int(m.group(1)), m.group(2)))
            if m.group(3):
                active.append(int(m.group(1)))
        rest = lines[1:]
        for n, line in rest:
            if not _PROFILE_PARAM_ROW.match(line):
                raise AmdgpuFormatError(file, "not a profile parameter row", n, line)
    else:
        if first.startswith("NUM") and "MODE_NAME" in first:
            layout = "smu7" if "SCLK_UP_HYST" in first else "vega10"
            rest = lines[1:]
        elif first.startswith("PROFILE_INDEX(NAME)"):
            layout = "smu11"
            rest = lines[1:]
        else:
            layout = "list"
            rest = lines
        for n, line in rest:
            m = (_PROFILE_LIST if layout == "list" else _PROFILE_ROW).match(line)
            if m:
                profiles.append((int(m.group(1)), m.group(2)))
                if m.group(3):
                    active.append(int(m.group(1)))
                continue
            if layout == "smu11" and _PROFILE_SUBROW.match(line):
                continue
            raise AmdgpuFormatError(file, f"not a profile line of the {layout} layout", n, line)
    if not profiles:
        raise AmdgpuFormatError(file, "no profiles listed")
    if len(active) > 1:
        raise AmdgpuFormatError(file, f"several profiles marked active: {active}")
    names = dict(profiles)
    idx = active[0] if active else None
    return PowerProfiles(layout, tuple(profiles), idx, names.get(idx) if idx is not None else None)


# ----------------------------------------------------------------- gpu_od/fan_ctrl/*


@dataclass(frozen=True)
class FanCurve:
    """`gpu_od/fan_ctrl/fan_curve` (SMU13/14): points (°C, %) and the allowed ranges."""

    points: tuple[tuple[int, int], ...]
    temp_range: tuple[int, int] | None
    speed_range: tuple[int, int] | None


_CURVE_POINT = re.compile(r"(\d+):\s*(-?\d+)C\s+(\d+)%\Z")
_CURVE_RANGE = re.compile(r"FAN_CURVE\((hotspot temp|fan speed)\):\s*(-?\d+)(C|%)\s+(-?\d+)(C|%)\Z")


def parse_fan_curve(data: bytes | str, file: str = "gpu_od/fan_ctrl/fan_curve") -> FanCurve:
    section = None
    points: list[tuple[int, int]] = []
    ranges: dict[str, tuple[int, int]] = {}
    for n, line in numbered_lines(data):
        if line in ("OD_FAN_CURVE:", "OD_RANGE:"):
            section = line
            continue
        if section == "OD_FAN_CURVE:":
            m = _CURVE_POINT.match(line)
            if m and int(m.group(1)) == len(points):
                points.append((int(m.group(2)), int(m.group(3))))
                continue
        elif section == "OD_RANGE:":
            m = _CURVE_RANGE.match(line)
            if m and m.group(3) == m.group(5) == ("C" if m.group(1) == "hotspot temp" else "%"):
                ranges[m.group(1)] = (int(m.group(2)), int(m.group(4)))
                continue
        raise AmdgpuFormatError(file, "unexpected line in the fan curve", n, line)
    if not points:
        raise AmdgpuFormatError(file, "no OD_FAN_CURVE points")
    return FanCurve(tuple(points), ranges.get("hotspot temp"), ranges.get("fan speed"))


@dataclass(frozen=True)
class OdFanSetting:
    """One-value `gpu_od/fan_ctrl/*` file (acoustic_limit_rpm_threshold,
    acoustic_target_rpm_threshold, fan_target_temperature, fan_minimum_pwm,
    fan_zero_rpm_enable, fan_zero_rpm_stop_temperature): `OD_<NAME>:`, the value, then
    `OD_RANGE:` and `<NAME>: min max`."""

    name: str
    value: int
    range: tuple[int, int] | None


def parse_od_fan_setting(data: bytes | str, file: str) -> OdFanSetting:
    lines = numbered_lines(data)
    if len(lines) < 2:
        raise AmdgpuFormatError(file, "expected a section header and a value")
    (n0, head), (n1, value) = lines[0], lines[1]
    m = re.fullmatch(r"(?:OD_)?([A-Z][A-Z0-9_]*):", head)
    if not m:
        raise AmdgpuFormatError(file, "expected 'OD_<NAME>:'", n0, head)
    name = m.group(1)
    if not _INT.match(value):
        raise AmdgpuFormatError(file, "expected an integer", n1, value)
    rng = None
    tail = lines[2:]
    if tail:
        (n2, r_head), r_lines = tail[0], tail[1:]
        if r_head != "OD_RANGE:" or len(r_lines) != 1:
            raise AmdgpuFormatError(file, "expected 'OD_RANGE:' and one range line", n2, r_head)
        n3, r_line = r_lines[0]
        rm = re.fullmatch(r"([A-Z][A-Z0-9_]*):\s*(-?\d+)\s+(-?\d+)", r_line)
        if not rm or not name.endswith(rm.group(1)):
            raise AmdgpuFormatError(file, f"expected '<NAME>: min max' for {name}", n3, r_line)
        rng = (int(rm.group(2)), int(rm.group(3)))
    return OdFanSetting(name.lower(), int(value), rng)
