"""amdgpu overdrive (`pp_od_clk_voltage`) as the kernel implements it, per SMU generation.

Owns: parsing a write the way `amdgpu_set_pp_od_clk_voltage()` does, the per-ASIC
`*_od_edit_dpm_table()` semantics (staging, range checks, `r`, `c`), and rendering the
file the way `amdgpu_get_pp_od_clk_voltage()` does — including the NUL gaps of the
`print_clock_levels` fallback era. Source: reference/amdgpu-od-protocol.md.

Kernel facts reproduced on purpose (they are what the daemon must cope with):
- Reading the file prints the driver's *staging* table, not what the SMU runs: a read-back
  right after `s`/`vo` shows the new value before `c` (INCIDENTS §3, "a read-back only
  echoes what sysfs stored"). `active` is what was last uploaded by `c`.
- Every ASIC-level refusal is EINVAL at sysfs; the reason is only in the kernel log.
- Values of a multi-pair line that passed their own check stay staged even when a later
  pair (or the whole-line min>max check) fails: the kernel assigns before it checks.
- SMU14 before upstream d9d4cb224e41 ("old" format) prints the firmware *limits* under
  OD_SCLK_OFFSET, never the setting, and takes `s 1 <offset>`; after it, `s <offset>`.
- Navi2x checks `s 0 X` against the *currently staged* max immediately (order matters),
  and does not range-check `vo`.
Log texts are the kernel's format strings where amdgpu-od-protocol.md or the SMU source
quotes them; the few it does not quote follow the same files' wording.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Callable

# Section order of the K611 print_clock_levels fallback (NUL-gap era) and of the newer
# emit_clock_levels path (amdgpu-od-protocol.md §1.3).
FALLBACK_ORDER = ("SCLK", "MCLK", "VDDC_CURVE", "VDDGFX_OFFSET", "RANGE", "CCLK")
EMIT_ORDER = ("SCLK", "MCLK", "VDDC_CURVE", "RANGE", "VDDGFX_OFFSET", "CCLK")
PAGE_SIZE = 4096


class OdRefused(Exception):
    """The write fails at sysfs with `errno` (always EINVAL for pp_od_clk_voltage);
    `log` is the kernel log line the driver printed first (None: it printed nothing)."""

    def __init__(self, log: str | None = None, err: int = errno.EINVAL, extra: tuple[str, ...] = ()):
        super().__init__(log or os.strerror(err))
        self.errno = err
        self.log = log
        self.extra = extra


def kstrtol(tok: str) -> int:
    """The kernel's kstrtol(s, 0): optional sign, 0x → hex, leading 0 → octal, one
    trailing newline allowed; anything else is -EINVAL."""
    s = tok[:-1] if tok.endswith("\n") else tok
    neg = False
    if s[:1] in "+-" and s:
        neg = s[0] == "-"
        s = s[1:]
    if not s:
        raise ValueError(tok)
    if s[:2].lower() == "0x":
        base, digits = 16, s[2:]
    elif s[0] == "0" and len(s) > 1:
        base, digits = 8, s[1:]
    else:
        base, digits = 10, s
    if not digits or not all(c in "0123456789abcdefABCDEF"[: base if base <= 10 else 22] for c in digits):
        raise ValueError(tok)
    value = int(digits, base)
    value = -value if neg else value
    if not -(2**63) <= value < 2**63:
        raise ValueError(tok)  # -ERANGE, which sysfs also turns into EINVAL here
    return value


def parse_command(data: bytes) -> tuple[str, list[int]]:
    """Split a write into (command, params) exactly like amdgpu_set_pp_od_clk_voltage.
    Raises OdRefused(None) for what the sysfs layer itself rejects (no log line)."""
    count = len(data)
    if count == 0 or count > 127:
        raise OdRefused(None)
    text = data.decode("latin-1")
    text = text.split("\0", 1)[0]
    if not text:
        raise OdRefused(None)
    if text[0] in "spmrc":
        cmd, rest = text[0], text[1:]
    elif text.startswith("vc") or text.startswith("vo"):
        cmd, rest = text[:2], text[2:]
    else:
        raise OdRefused(None)
    # `while (isspace(*++tmp_str));` then strsep on " \n"
    rest = rest.lstrip(" \t\n\r\v\f")
    params: list[int] = []
    for tok in rest.replace("\n", " ").split(" "):
        if not tok:
            continue
        try:
            params.append(kstrtol(tok))
        except ValueError:
            raise OdRefused(None) from None
        if len(params) > 64:
            raise OdRefused(None)
    return cmd, params


def assemble(sections: dict[str, str], nul_gaps: bool) -> bytes:
    """The whole file from per-section text, as the kernel's show() returns it."""
    if nul_gaps:
        # size += print(buf + size): each helper returns an offset-inclusive size, so
        # the caller double-counts and leaves zero-filled gaps (SOURCES.md).
        buf = bytearray()
        size = 0
        for name in FALLBACK_ORDER:
            text = sections.get(name, "").encode()
            offset = size
            if len(buf) < offset:
                buf.extend(b"\0" * (offset - len(buf)))
            buf[offset:offset + len(text)] = text
            size += offset + len(text)
        size = min(size, PAGE_SIZE)
        if len(buf) < size:
            buf.extend(b"\0" * (size - len(buf)))
        out = bytes(buf[:size])
    else:
        out = "".join(sections.get(n, "") for n in EMIT_ORDER).encode()
    return out if out else b"\n"


@dataclass
class OdTable:
    """Common state of one card's OD table. Subclasses implement one ASIC family.

    `boot` = VBIOS defaults, `staged` = the driver's edit copy (what reads print),
    `active` = last table uploaded to the SMU (what the card runs)."""

    boot: dict
    ranges: dict[str, tuple[int, int]]
    staged: dict = field(default_factory=dict)
    active: dict = field(default_factory=dict)

    family = "abstract"

    def __post_init__(self) -> None:
        self.staged = dict(self.boot)
        self.active = dict(self.boot)

    # -- write path -----------------------------------------------------------------
    def edit(self, cmd: str, params: list[int], dev: Callable[[str], None]) -> None:
        """Apply one parsed command. `dev(msg)` prints a dev_info/dev_err line."""
        if cmd == "c":
            self.commit()
            return
        if cmd == "r":
            if len(params) == 1:
                return  # SMU13/14: resets one fan_ctrl item; no clock/voltage effect
            if params:
                raise OdRefused(None)
            self.restore(dev)
            return
        handler = {"s": self.edit_sclk, "m": self.edit_mclk, "vo": self.edit_vo, "vc": self.edit_vc}.get(cmd)
        if handler is None:  # 'p' (CCLK) on a dGPU: -ENOSYS from the ASIC → EINVAL
            raise OdRefused(None)
        handler(params, dev)

    def commit(self) -> bool:
        """Upload the staging table when it differs; True if anything changed."""
        if self.staged != self.active:
            self.active = dict(self.staged)
            return True
        return False

    def restore(self, dev) -> None:
        """`r`: restore the boot table and fall through to commit (SMU11 Navi2x/13/14)."""
        self.staged = dict(self.boot)
        self.commit()

    def reset(self) -> None:
        """A GPU reset re-inits the SMU: stock values, silently."""
        self.staged = dict(self.boot)
        self.active = dict(self.boot)

    def edit_sclk(self, params, dev):
        raise OdRefused(None)

    def edit_mclk(self, params, dev):
        raise OdRefused(None)

    def edit_vo(self, params, dev):
        raise OdRefused(None)

    def edit_vc(self, params, dev):
        raise OdRefused(None)

    # -- shared checks --------------------------------------------------------------
    def _pairs(self, params, dev) -> list[tuple[int, int]]:
        if len(params) % 2:
            dev(f"invalid number of parameters: {len(params)}")
            raise OdRefused(f"invalid number of parameters: {len(params)}")
        return [(params[i], params[i + 1]) for i in range(0, len(params), 2)]

    def _in_range(self, knob: str, rng: str, value: int, dev, fmt: str) -> None:
        lo, hi = self.ranges[rng]
        if value < lo or value > hi:
            msg = fmt.format(value=value, lo=lo, hi=hi, knob=knob)
            dev(msg)
            raise OdRefused(msg)

    def _minmax(self, lo_key: str, hi_key: str, label: str, dev) -> None:
        if self.staged[lo_key] > self.staged[hi_key]:
            msg = (f"Invalid setting: {label}Fmin({self.staged[lo_key]}) is bigger than "
                   f"{label}Fmax({self.staged[hi_key]})")
            dev(msg)
            raise OdRefused(msg)

    def _mclk_pairs(self, params, dev) -> None:
        for idx, val in self._pairs(params, dev):
            if idx == 0:
                self._in_range("UclkFmin", "MCLK", val, dev, "UclkFmin ({value}) must be within [{lo}, {hi}]!")
                self.staged["mclk_min"] = val
            elif idx == 1:
                self._in_range("UclkFmax", "MCLK", val, dev, "UclkFmax ({value}) must be within [{lo}, {hi}]!")
                self.staged["mclk_max"] = val
            else:
                dev(f"Invalid MCLK_VDDC_TABLE index: {idx}")
                dev("Supported indices: [0:min,1:max]")
                raise OdRefused(f"Invalid MCLK_VDDC_TABLE index: {idx}")
        self._minmax("mclk_min", "mclk_max", "Uclk", dev)

    def _vo_checked(self, params, dev) -> None:
        if len(params) != 1:
            dev(f"invalid number of parameters: {len(params)}")
            raise OdRefused(f"invalid number of parameters: {len(params)}")
        self._in_range("vo", "VDDGFX_OFFSET", params[0], dev, "Voltage offset ({value}) must be within [{lo}, {hi}]!")
        self.staged["vddgfx_offset"] = params[0]

    # -- read path ------------------------------------------------------------------
    def sections(self) -> dict[str, str]:
        raise NotImplementedError

    def render(self, nul_gaps: bool) -> bytes:
        return assemble(self.sections(), nul_gaps)

    # -- what the load model needs --------------------------------------------------
    def effective(self) -> dict:
        """Active values for the load model: sclk_max / sclk_offset, mclk_max, vddgfx_offset."""
        return dict(self.active)


def _mclk_section(t: dict) -> str:
    # `1: %uMHz` with capital H is the kernel's own inconsistency (SOURCES.md).
    return f"OD_MCLK:\n0: {t['mclk_min']}Mhz\n1: {t['mclk_max']}MHz\n"


class Smu14Od(OdTable):
    """Navi48/44 (RX 9070, R9700): `s <offset>` (new) or `s 1 <offset>` (old, pre-fix)."""

    family = "smu14"

    def __init__(self, boot, ranges, fixed_format: bool = True):
        self.fixed_format = fixed_format
        super().__init__(boot, ranges)

    def edit_sclk(self, params, dev):
        lo, hi = self.ranges["SCLK_OFFSET"]
        if self.fixed_format:
            if len(params) != 1:
                dev(f"invalid number of input parameters {len(params)}")
                raise OdRefused(f"invalid number of input parameters {len(params)}")
            if params[0] < lo or params[0] > hi:
                msg = f"GfxclkFoffset must be within [{lo}, {hi}]!"
                dev(msg)
                raise OdRefused(msg)
            self.staged["sclk_offset"] = params[0]
            return
        # Old SMU14 code, copied from SMU13's min/max pairs: only index 1 means the offset.
        for idx, val in self._pairs(params, dev):
            if idx != 1:
                dev(f"Invalid SCLK_VDDC_TABLE index: {idx}")
                dev("Supported indices: [1:offset]")
                raise OdRefused(f"Invalid SCLK_VDDC_TABLE index: {idx}")
            if val < lo or val > hi:
                msg = f"GfxclkFoffset ({val}) must be within [{lo}, {hi}]!"
                dev(msg)
                raise OdRefused(msg)
            self.staged["sclk_offset"] = val

    def edit_mclk(self, params, dev):
        self._mclk_pairs(params, dev)

    def edit_vo(self, params, dev):
        self._vo_checked(params, dev)

    def sections(self):
        t = self.staged
        slo, shi = self.ranges["SCLK_OFFSET"]
        if self.fixed_format:
            sclk = f"OD_SCLK_OFFSET:\n{t['sclk_offset']}Mhz\n"
        else:
            # Pre-d9d4cb224e41: the firmware limits, not the setting (SOURCES.md mar2025).
            sclk = f"OD_SCLK_OFFSET:\n0: {slo}Mhz\n1: {shi}Mhz\n"
        mlo, mhi = self.ranges["MCLK"]
        vlo, vhi = self.ranges["VDDGFX_OFFSET"]
        rng = ("OD_RANGE:\n"
               f"SCLK_OFFSET: {slo:7d}Mhz {shi:10d}Mhz\n"
               f"MCLK: {mlo:7d}Mhz {mhi:10d}Mhz\n"
               f"VDDGFX_OFFSET: {vlo:7d}mv {vhi:10d}mv\n")
        return {"SCLK": sclk, "MCLK": _mclk_section(t),
                "VDDGFX_OFFSET": f"OD_VDDGFX_OFFSET:\n{t['vddgfx_offset']}mV\n", "RANGE": rng}


class Smu13Od(OdTable):
    """Navi3x dGPUs (7900 XTX): `s 0|1 <MHz>` pairs, `m`, `vo` (≥ 6.7) or, on Linux 6.6,
    `vc <zone 0-5> <offset>` with an OD_VDDC_CURVE section instead of OD_VDDGFX_OFFSET."""

    family = "smu13"
    ZONES = 6

    def __init__(self, boot, ranges, vddc_curve: bool = False):
        self.vddc_curve = vddc_curve
        boot = dict(boot)
        boot.setdefault("vddc_zones", tuple([boot.get("vddgfx_offset", 0)] * self.ZONES))
        super().__init__(boot, ranges)

    def edit_sclk(self, params, dev):
        for idx, val in self._pairs(params, dev):
            if idx == 0:
                self._in_range("GfxclkFmin", "SCLK", val, dev, "GfxclkFmin ({value}) must be within [{lo}, {hi}]!")
                self.staged["sclk_min"] = val
            elif idx == 1:
                self._in_range("GfxclkFmax", "SCLK", val, dev, "GfxclkFmax ({value}) must be within [{lo}, {hi}]!")
                self.staged["sclk_max"] = val
            else:
                dev(f"Invalid SCLK_VDDC_TABLE index: {idx}")
                dev("Supported indices: [0:min,1:max]")
                raise OdRefused(f"Invalid SCLK_VDDC_TABLE index: {idx}")
        self._minmax("sclk_min", "sclk_max", "Gfxclk", dev)

    def edit_mclk(self, params, dev):
        self._mclk_pairs(params, dev)

    def edit_vo(self, params, dev):
        if self.vddc_curve:  # Linux 6.6 has no `vo` on SMU13
            raise OdRefused(None)
        self._vo_checked(params, dev)
        self.staged["vddc_zones"] = tuple([params[0]] * self.ZONES)

    def edit_vc(self, params, dev):
        if not self.vddc_curve:
            raise OdRefused(None)
        if len(params) != 2:
            dev(f"invalid number of parameters: {len(params)}")
            raise OdRefused(f"invalid number of parameters: {len(params)}")
        zone, val = params
        if zone < 0 or zone >= self.ZONES:
            dev(f"Invalid VDDC_CURVE index: {zone}")
            raise OdRefused(f"Invalid VDDC_CURVE index: {zone}")
        self._in_range("vc", "VDDGFX_OFFSET", val, dev, "Voltage offset ({value}) must be within [{lo}, {hi}]!")
        zones = list(self.staged["vddc_zones"])
        zones[zone] = val
        self.staged["vddc_zones"] = tuple(zones)
        self.staged["vddgfx_offset"] = round(sum(zones) / len(zones))

    def sections(self):
        t = self.staged
        slo, shi = self.ranges["SCLK"]
        mlo, mhi = self.ranges["MCLK"]
        vlo, vhi = self.ranges["VDDGFX_OFFSET"]
        out = {"SCLK": f"OD_SCLK:\n0: {t['sclk_min']}Mhz\n1: {t['sclk_max']}Mhz\n",
               "MCLK": _mclk_section(t)}
        rng = f"OD_RANGE:\nSCLK: {slo:7d}Mhz {shi:10d}Mhz\nMCLK: {mlo:7d}Mhz {mhi:10d}Mhz\n"
        if self.vddc_curve:
            out["VDDC_CURVE"] = "OD_VDDC_CURVE:\n" + "".join(
                f"{i}: {v}mv\n" for i, v in enumerate(t["vddc_zones"]))
            rng += f"VDDC_CURVE: {vlo:7d}mv {vhi:10d}mv\n"
        else:
            out["VDDGFX_OFFSET"] = f"OD_VDDGFX_OFFSET:\n{t['vddgfx_offset']}mV\n"
            rng += f"VDDGFX_OFFSET: {vlo:7d}mv {vhi:10d}mv\n"
        out["RANGE"] = rng
        return out


class Navi2xOd(OdTable):
    """Navi2x (sienna_cichlid, RX 6000): min/max checked against the other staged bound at
    once; `vo` without range check and without a range line."""

    family = "navi2x"

    def _pair_knob(self, prefix: str, lo_key: str, hi_key: str, rng: str, params, dev, what: str):
        for i in range(0, len(params), 2):
            if i + 2 > len(params):
                dev(f"invalid number of input parameters {len(params)}")
                raise OdRefused(f"invalid number of input parameters {len(params)}")
            idx, val = params[i], params[i + 1]
            if idx == 0:
                if val > self.staged[hi_key]:
                    msg = f"{prefix}Fmin ({val}) must be <= {prefix}Fmax ({self.staged[hi_key]})!"
                    dev(msg)
                    raise OdRefused(msg)
                key = lo_key
            elif idx == 1:
                if val < self.staged[lo_key]:
                    msg = f"{prefix}Fmax ({val}) must be >= {prefix}Fmin ({self.staged[lo_key]})!"
                    dev(msg)
                    raise OdRefused(msg)
                key = hi_key
            else:
                dev(f"Invalid {what}_VDDC_TABLE index: {idx}")
                dev("Supported indices: [0:min,1:max]")
                raise OdRefused(f"Invalid {what}_VDDC_TABLE index: {idx}")
            lo, hi = self.ranges[rng]
            if val < lo or val > hi:
                msg = f"OD setting ({key}, {val}) out of range [{lo}, {hi}]"
                dev(msg)
                raise OdRefused(msg)
            self.staged[key] = val

    def edit_sclk(self, params, dev):
        self._pair_knob("Gfxclk", "sclk_min", "sclk_max", "SCLK", params, dev, "SCLK")

    def edit_mclk(self, params, dev):
        self._pair_knob("Uclk", "mclk_min", "mclk_max", "MCLK", params, dev, "MCLK")

    def edit_vo(self, params, dev):
        if len(params) != 1:
            dev(f"invalid number of parameters: {len(params)}")
            raise OdRefused(f"invalid number of parameters: {len(params)}")
        self.staged["vddgfx_offset"] = params[0]  # no range check on Navi2x

    def sections(self):
        t = self.staged
        slo, shi = self.ranges["SCLK"]
        mlo, mhi = self.ranges["MCLK"]
        return {"SCLK": f"OD_SCLK:\n0: {t['sclk_min']}Mhz\n1: {t['sclk_max']}Mhz\n",
                "MCLK": _mclk_section(t),
                "VDDGFX_OFFSET": f"OD_VDDGFX_OFFSET:\n{t['vddgfx_offset']}mV\n",
                "RANGE": f"OD_RANGE:\nSCLK: {slo:7d}Mhz {shi:10d}Mhz\nMCLK: {mlo:7d}Mhz {mhi:10d}Mhz\n"}
