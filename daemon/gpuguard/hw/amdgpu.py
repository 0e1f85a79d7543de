"""AMD GPUs: discovery on a `SysfsRoot` and one telemetry read per GPU (`read_gpu`).

Owns how an amdgpu card is found and which files a poll reads. File formats live in
`amdgpu_files` (small files) and `amdgpu_od` (`pp_od_clk_voltage`).

- A GPU is a PCI device of display class (0x03xxxx) bound to the `amdgpu` driver, named by
  its PCI address; `drm/cardN` is only today's name (INCIDENTS §8: indices swap between
  boots). The hwmon folder is the one whose `name` is `amdgpu`, sensors are found by their
  `*_label`, never by number: hwmon numbering changes between boots.
- Every file a poll reads is resolved once at discovery (`AmdGpuDevice.poll_paths()`); a
  poll only reads and parses, so it stays close to a bare `os.read` loop.
- Each value is read on its own: a failure leaves that value None with the reason in
  `errors`; ENODEV, or ENOENT with the device folder gone, means the GPU is lost (`up=False`).
- A runtime-suspended GPU is not woken: only `power/runtime_status` is read.
"""
from __future__ import annotations

import errno as errno_mod
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from gpuguard.hw import amdgpu_files as files
from gpuguard.hw import plausible
from gpuguard.hw.amdgpu_od import parse_od
from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.state.snapshot import GpuSnapshot

log = logging.getLogger(__name__)

PCI_DEVICES = "/sys/bus/pci/devices"
PPFEATUREMASK = "/sys/module/amdgpu/parameters/ppfeaturemask"
PP_OVERDRIVE_MASK = 0x4000  # include/amd_shared.h; clear in the module default 0xfff7bfff
DEFAULT_PPFEATUREMASK = 0xFFF7BFFF
DRIVER = "amdgpu"

# PCI device id -> name, for the cards in reference/amdgpu and the incident host. One id
# covers several boards (73ff: RX 6600 and 6600 XT), so the names say so.
MODELS = {
    "744c": "Radeon RX 7900 XTX",
    "7551": "Radeon AI PRO R9700",
    "7550": "Radeon RX 9070 / 9070 XT",
    "747e": "Radeon RX 7700 XT / 7800 XT",
    "7480": "Radeon RX 7600 / 7600S / 7700S",
    "73bf": "Radeon RX 6800 / 6800 XT / 6900 XT",
    "73ff": "Radeon RX 6600 / 6600 XT",
    "731f": "Radeon RX 5600 XT / 5700 / 5700 XT",
    "7340": "Radeon RX 5500 XT",
    "687f": "Radeon RX Vega 56 / 64",
    "67df": "Radeon RX 470 / 480 / 570 / 580",
    "679a": "Radeon HD 7950 / R9 280",
    "6617": "Radeon R7 240",
    "6818": "Radeon HD 7870",
    "15bf": "Radeon 780M (Phoenix)",
    "150e": "Radeon 880M / 890M (Strix Point)",
    "163f": "Van Gogh (Steam Deck)",
}


def model_name(vendor: str, device_id: str) -> str:
    if vendor == "1002" and device_id in MODELS:
        return MODELS[device_id]
    return f"AMD GPU {vendor}:{device_id}"


# --------------------------------------------------------------------------- records

Parse = Callable[[bytes, str], object]


@dataclass(frozen=True)
class Probe:
    """One value a poll reads: `key` names it in `GpuSnapshot.errors`; `group`/`label`
    say where it goes (`None` = the snapshot field named `key`). A `constant` is a number
    of the card's firmware that does not change while the driver holds it (VRAM size, the
    temperature limits, the cap's bounds and default): read at discovery, then once every
    `CONSTANT_EVERY_S`, not every poll (issue 15: 11 of a card's 25 files)."""

    key: str
    path: str
    parse: Parse
    group: str | None = None
    label: object = None
    constant: bool = False


# How long a constant read is served before it is read again: a firmware that did change
# one (a driver reload rediscovers the card anyway) shows it within the minute.
CONSTANT_EVERY_S = 60.0


_GROUPS = (None, "temperatures", "temperature_limits", "clocks_hz", "voltages")


@dataclass(frozen=True)
class AmdGpuDevice:
    """One amdgpu GPU as found at discovery, with every poll path resolved."""

    bdf: str  # 0000:03:00.0: the identity
    vendor: str  # "1002"
    device_id: str  # "744c"
    subsystem: str  # "1da2:e471"
    revision: str  # "c8"
    model: str
    card: str | None  # drm cardN today (informational)
    hwmon_path: str | None  # /sys/devices/.../hwmon/hwmon3 today
    sysfs_path: str  # canonical device folder, /sys/devices/pci0000:00/.../0000:03:00.0
    pci_class: str  # "0x030000"
    runtime_status_path: str | None = None
    od_path: str | None = None
    od_disabled_reason: str | None = None  # why `od_path` is None
    probes: tuple[Probe, ...] = field(default=(), repr=False)
    # the hwmon folder an earlier discovery of this card found, gone at this one (hw/sources.py):
    # its sensors are an error every poll, and a folder under hwmon/ again is looked at
    hwmon_gone: str | None = None

    def __post_init__(self) -> None:
        # The poll loop walks plain tuples (no attribute lookups per value).
        plan = tuple((p.key, p.path, p.parse, _GROUPS.index(p.group), p.label, p.constant) for p in self.probes)
        object.__setattr__(self, "_plan", plan)
        # key -> (monotonic time read, value) of the constants; written by the one thread
        # that polls this device at a time (poller.py never reads a card twice at once)
        object.__setattr__(self, "_constants", {})

    def poll_paths(self) -> tuple[str, ...]:
        """Host-style paths a `read_gpu` of an awake GPU reads, in order (for the
        benchmark's raw `os.read` loop)."""
        paths = [self.runtime_status_path] if self.runtime_status_path else []
        paths += [p.path for p in self.probes]
        if self.od_path:
            paths.append(self.od_path)
        return tuple(paths)


# ------------------------------------------------------------------------- discovery


def _hexid(root: SysfsRoot, path: str) -> str:
    """`0x1002` -> `1002`; garbage raises ValueError naming the file."""
    text = root.read_text(path)
    if not re.fullmatch(r"0x[0-9a-fA-F]+", text):
        raise ValueError(f"{path}: expected a hex id like 0x1002, read {text[:40]!r}")
    return text[2:].lower()


def discover(root: SysfsRoot) -> list[AmdGpuDevice]:
    """Every display-class PCI device bound to amdgpu, sorted by PCI address. A device
    that vanishes or has unreadable ids while we look is skipped (logged)."""
    out = []
    for bdf in root.listdir(PCI_DEVICES):
        dev = discover_one(root, bdf)
        if dev is not None:
            out.append(dev)
    return out


def discover_one(root: SysfsRoot, bdf: str) -> AmdGpuDevice | None:
    """The amdgpu GPU at `bdf`, or None if there is none (gone, not a GPU, other driver).
    The poller calls this again when a snapshot says `extra["rediscover"]` (hwmon
    renumbered)."""
    link = f"{PCI_DEVICES}/{bdf}"
    try:
        pci_class = root.read_text(f"{link}/class")
        if not re.fullmatch(r"0x03[0-9a-fA-F]{4}", pci_class):
            return None
        if root.readlink_name(f"{link}/driver") != DRIVER:
            return None
        dev_path = root.realpath(link)
        vendor = _hexid(root, f"{dev_path}/vendor")
        device_id = _hexid(root, f"{dev_path}/device")
        sub_v = _hexid(root, f"{dev_path}/subsystem_vendor")
        sub_d = _hexid(root, f"{dev_path}/subsystem_device")
        try:
            revision = _hexid(root, f"{dev_path}/revision")
        except (SysfsError, ValueError):
            revision = ""
        cards = [c for c in root.listdir(f"{dev_path}/drm") if re.fullmatch(r"card\d+", c)]
        hwmon = _find_hwmon(root, dev_path)
        probes = _device_probes(root, dev_path) + (_hwmon_probes(root, hwmon) if hwmon else ())
        probes = probes + _dpm_fallback(root, dev_path, probes)
        od_path = f"{dev_path}/pp_od_clk_voltage"
        od_reason = None
        if not root.exists(od_path):
            od_path, od_reason = None, od_disabled_reason(root)
        rs = f"{dev_path}/power/runtime_status"
        return AmdGpuDevice(
            bdf=bdf,
            vendor=vendor,
            device_id=device_id,
            subsystem=f"{sub_v}:{sub_d}",
            revision=revision,
            model=model_name(vendor, device_id),
            card=cards[0] if cards else None,
            hwmon_path=hwmon,
            sysfs_path=dev_path,
            pci_class=pci_class,
            runtime_status_path=rs if root.exists(rs) else None,
            od_path=od_path,
            od_disabled_reason=od_reason,
            probes=probes,
        )
    except (SysfsError, ValueError) as e:
        log.warning("skipping PCI device %s during discovery: %s", bdf, e)
        return None


def _find_hwmon(root: SysfsRoot, dev_path: str) -> str | None:
    for entry in root.listdir(f"{dev_path}/hwmon"):
        path = f"{dev_path}/hwmon/{entry}"
        try:
            if root.read_text(f"{path}/name") == DRIVER:
                return path
        except SysfsError:
            continue
    return None


def _device_probes(root: SysfsRoot, dev: str) -> tuple[Probe, ...]:
    wanted = (
        ("busy_ratio", "gpu_busy_percent", files.parse_percent_ratio, False),
        ("vram_used_bytes", "mem_info_vram_used", files.parse_bytes, False),
        ("vram_total_bytes", "mem_info_vram_total", files.parse_bytes, True),
        ("vram_visible_bytes", "mem_info_vis_vram_total", files.parse_bytes, True),
        ("performance_level", "power_dpm_force_performance_level", files.parse_performance_level, False),
    )
    # A file the GPU does not have is "no data", not an error (node_exporter's rule).
    return tuple(Probe(key, f"{dev}/{name}", parse, constant=constant)
                 for key, name, parse, constant in wanted if root.exists(f"{dev}/{name}"))


# Live readings pass plausibility bounds (hw/plausible.py); limits do not.
_TEMP = plausible.bounded(files.parse_millicelsius, "temperature")
_POWER = plausible.bounded(files.parse_microwatts, "power")
_CLOCK = plausible.bounded(files.parse_hertz, "clock")
_VOLTAGE = plausible.bounded(files.parse_millivolts, "voltage")
_FAN = plausible.bounded(files.parse_rpm, "fan")

_SENSOR = re.compile(r"(temp|in|freq|power|fan)(\d+)_label\Z")


def _hwmon_probes(root: SysfsRoot, hw: str) -> tuple[Probe, ...]:
    entries = set(root.listdir(hw))
    labels: dict[tuple[str, int], str] = {}
    for name in entries:
        m = _SENSOR.match(name)
        if m:
            try:
                path = f"{hw}/{name}"
                labels[(m.group(1), int(m.group(2)))] = files.parse_label(root.read_bytes(path), path)
            except (SysfsError, ValueError) as e:
                log.warning("hwmon label unreadable: %s", e)
    probes: list[Probe] = []

    def has(name: str) -> bool:
        return name in entries

    # Temperatures by label (edge/junction/mem), with their crit/emergency limits.
    for (kind, n), label in sorted(labels.items()):
        if kind == "temp" and has(f"temp{n}_input"):
            probes.append(
                Probe(f"temperature_{label}", f"{hw}/temp{n}_input", _TEMP, "temperatures", label)
            )
            for level in ("crit", "emergency"):
                if has(f"temp{n}_{level}"):
                    key, path = f"temperature_{label}_{level}", f"{hw}/temp{n}_{level}"
                    probes.append(Probe(key, path, files.parse_millicelsius, "temperature_limits", (label, level),
                                        constant=True))
    # Package power: the PPT sensor (slowPPT on VanGogh, which also has fastPPT).
    ppt = [i for (kind, i), label in sorted(labels.items()) if kind == "power" and label in ("PPT", "slowPPT")]
    n = ppt[0] if ppt else (1 if has("power1_average") or has("power1_input") else None)
    if n is not None:
        # power1_average is gone on newer RDNA3+ kernels, where power1_input is the reading.
        for name in (f"power{n}_average", f"power{n}_input"):
            if has(name):
                probes.append(Probe("power_watts", f"{hw}/{name}", _POWER))
                break
        for suffix in ("cap", "cap_min", "cap_max", "cap_default"):
            key = f"power_{suffix}_watts"
            if has(f"power{n}_{suffix}"):  # the cap itself is set by users and profiles: not a constant
                probes.append(Probe(key, f"{hw}/power{n}_{suffix}", _POWER, constant=suffix != "cap"))
    for (kind, n), label in sorted(labels.items()):
        if kind == "freq" and has(f"freq{n}_input"):
            probes.append(Probe(f"clock_{label}", f"{hw}/freq{n}_input", _CLOCK, "clocks_hz", label))
        elif kind == "in" and has(f"in{n}_input"):
            probes.append(Probe(f"voltage_{label}", f"{hw}/in{n}_input", _VOLTAGE, "voltages", label))
    if has("fan1_input"):
        probes.append(Probe("fan_rpm", f"{hw}/fan1_input", _FAN))
    return tuple(probes)


def _dpm_current_hz(data: bytes, path: str) -> float:
    mhz = files.parse_dpm(data, path).current_mhz
    if mhz is None:
        raise files.AmdgpuFormatError(path, "no DPM level marked '*'")
    return plausible.check("clock", mhz * 1e6, path)


def _dpm_fallback(root: SysfsRoot, dev: str, have: tuple[Probe, ...]) -> tuple[Probe, ...]:
    """sclk/mclk from the `*` level of pp_dpm_sclk/mclk where hwmon has no freqN."""
    got = {p.label for p in have if p.group == "clocks_hz"}
    out = []
    for clk in ("sclk", "mclk"):
        path = f"{dev}/pp_dpm_{clk}"
        if clk not in got and root.exists(path):
            out.append(Probe(f"clock_{clk}", path, _dpm_current_hz, "clocks_hz", clk))
    return tuple(out)


def od_disabled_reason(root: SysfsRoot) -> str:
    """Why a dGPU has no `pp_od_clk_voltage`, and the kernel parameter that fixes it
    (protocol §1.1: the file exists only with bit 0x4000 of amdgpu.ppfeaturemask, which is
    read-only after module load)."""
    try:
        text = root.read_text(PPFEATUREMASK)
        mask = int(text, 0)
    except (SysfsError, ValueError) as e:
        want = DEFAULT_PPFEATUREMASK | PP_OVERDRIVE_MASK
        return (
            f"OD is disabled (no pp_od_clk_voltage) and {PPFEATUREMASK} could not be read ({e}); "
            f"add amdgpu.ppfeaturemask={want:#x} (the default {DEFAULT_PPFEATUREMASK:#x} plus the "
            f"overdrive bit {PP_OVERDRIVE_MASK:#x}) to the kernel command line and reboot"
        )
    if mask & PP_OVERDRIVE_MASK:
        return (
            f"no pp_od_clk_voltage although amdgpu.ppfeaturemask={mask:#x} has the overdrive bit "
            f"{PP_OVERDRIVE_MASK:#x}: this card or its VBIOS does not support OD "
            "(dmesg: 'overdrive feature is not supported')"
        )
    return (
        f"OD is disabled at module load: amdgpu.ppfeaturemask={mask:#x} lacks the overdrive bit "
        f"{PP_OVERDRIVE_MASK:#x}; add amdgpu.ppfeaturemask={mask | PP_OVERDRIVE_MASK:#x} to the "
        "kernel command line and reboot (the parameter cannot change at runtime)"
    )


# --------------------------------------------------------------------------- polling

# Runtime-PM states in which a read would wake the GPU (older kernels) or fail with
# EPERM/EBUSY (newer ones): report the state and read nothing else.
_ASLEEP = frozenset({"suspended", "suspending"})
_TRANSIENT = (errno_mod.EPERM, errno_mod.EBUSY, errno_mod.EAGAIN)


# Values the GPU produces live; the rest (VRAM size, limits) are cached by the driver.
_LIVE = ("power_watts", "busy_ratio", "fan_rpm")


class _Lost(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _read_error(root: SysfsRoot, dev: AmdGpuDevice, e: SysfsError) -> str:
    """The text for `errors[...]`; raises _Lost when the GPU itself is gone."""
    if e.errno == errno_mod.ENODEV or (e.gone and not root.exists(dev.sysfs_path)):
        raise _Lost(f"GPU {dev.bdf} is gone: {e}")
    if e.errno in _TRANSIENT:
        # protocol §1.4/§5: EPERM/EBUSY on a read = asleep or resetting, not permissions.
        return f"{e} (GPU resetting or runtime-suspended; transient)"
    return str(e)


def read_gpu(root: SysfsRoot, dev: AmdGpuDevice, name: str) -> GpuSnapshot:
    """One snapshot of `dev`. Synchronous; the poller runs it in a thread with a timeout.
    Never raises for hardware faults: they end up in `errors`, `up` and `od_error`."""
    now = time.time()
    ident = dict(
        name=name,
        bdf=dev.bdf,
        vendor=dev.vendor,
        device_id=dev.device_id,
        driver=DRIVER,
        model=dev.model,
        card=dev.card,
        time=now,
    )
    errors: dict[str, str] = {}
    runtime_status = None
    try:
        if dev.runtime_status_path:
            try:
                runtime_status = root.read_text(dev.runtime_status_path)
            except SysfsError as e:
                errors["runtime_status"] = _read_error(root, dev, e)
            if runtime_status in _ASLEEP:
                return GpuSnapshot(up=True, runtime_status=runtime_status, errors=errors, **ident)
        fields: dict[str, object] = {}
        groups: list[dict] = [fields, {}, {}, {}, {}]  # indexed like _GROUPS
        stale = False
        if dev.hwmon_gone:
            # a folder that vanished and came back under the same name was never read again
            # (power and fan absent, no error): say so each poll, look again once it is there
            errors["hwmon"] = (f"{dev.hwmon_gone}: gone; power, temperatures, clocks, voltages and fan are not read "
                               f"until an amdgpu hwmon folder is back under {dev.sysfs_path}/hwmon")
            stale = bool(root.listdir(f"{dev.sysfs_path}/hwmon"))
        io_errors: list[str] = []
        read = root.read_bytes
        constants = dev._constants
        fresh_after = time.monotonic() - CONSTANT_EVERY_S
        for key, path, parse, gi, label, constant in dev._plan:
            if constant:
                kept = constants.get(key)
                if kept is not None and kept[0] > fresh_after:
                    groups[gi][key if gi == 0 else label] = kept[1]
                    continue
            try:
                value = parse(read(path), path)
            except SysfsError as e:
                errors[key] = _read_error(root, dev, e)
                io_errors.append(errors[key])
                stale = stale or e.gone
                constants.pop(key, None)
                continue
            except ValueError as e:
                errors[key] = str(e)
                constants.pop(key, None)
                continue
            groups[gi][key if gi == 0 else label] = value
            if constant:
                constants[key] = (time.monotonic(), value)
        od = None
        od_error = dev.od_disabled_reason
        if dev.od_path:
            try:
                od = parse_od(root.read_bytes(dev.od_path), dev.od_path)
            except SysfsError as e:
                od_error = errors["od"] = _read_error(root, dev, e)
                stale = stale or e.gone
            except ValueError as e:
                od_error = errors["od"] = str(e)
        live_ok = bool(groups[1] or groups[3]) or any(fields.get(k) is not None for k in _LIVE)
        if not live_ok and io_errors:
            # No live sensor answers: the card is not answering (INCIDENTS §1: a GPU falling
            # off the bus answers EIO before its directory vanishes). Cached values such as
            # mem_info_vram_total or hwmon limits still read fine then; they prove nothing.
            raise _Lost(f"GPU {dev.bdf} is not answering: every live sensor read failed ({io_errors[0]})")
    except _Lost as lost:
        errors["device"] = lost.reason
        return GpuSnapshot(up=False, runtime_status=runtime_status, errors=errors, **ident)
    extra = {}
    if stale:
        # A file found at discovery is gone but the device is not: hwmon renumbered or a
        # driver reload; discover_one(bdf) again.
        extra["rediscover"] = True
    return GpuSnapshot(
        up=True,
        runtime_status=runtime_status,
        od=od,
        od_error=od_error,
        errors=errors,
        extra=extra,
        temperatures=groups[1],
        temperature_limits=groups[2],
        clocks_hz=groups[3],
        voltages=groups[4],
        **fields,
        **ident,
    )


# ------------------------------------------------------------- parser per file name

_PARSERS: tuple[tuple[re.Pattern, Parse], ...] = tuple(
    (re.compile(pattern + r"\Z"), parse)
    for pattern, parse in (
        (r"pp_od_clk_voltage", parse_od),
        (r"pp_dpm_\w+", files.parse_dpm),
        (r"pp_power_profile_mode", files.parse_power_profile_mode),
        (r"fan_curve", files.parse_fan_curve),
        (
            r"acoustic_(limit|target)_rpm_threshold|fan_target_temperature|fan_minimum_pwm"
            r"|fan_zero_rpm_(enable|stop_temperature)",
            files.parse_od_fan_setting,
        ),
        (r"(current|max)_link_speed", files.parse_link_speed),
        (r"(current|max)_link_width", files.parse_link_width),
        (r"(gpu|mem)_busy_percent", files.parse_percent_ratio),
        (r"mem_info_(vis_)?vram_(total|used)|mem_info_gtt_(total|used)", files.parse_bytes),
        (r"power_dpm_force_performance_level", files.parse_performance_level),
        (r"vbios_version", files.parse_vbios_version),
        (r"unique_id", files.parse_unique_id),
        (r"uevent", files.parse_uevent),
        (r"name|\w+\d+_label", files.parse_label),
        (r"power\d+_(average|input|cap|cap_min|cap_max|cap_default)", files.parse_microwatts),
        (r"temp\d+_(input|crit|crit_hyst|emergency|emergency_hyst)", files.parse_millicelsius),
        (r"in\d+_input", files.parse_millivolts),
        (r"freq\d+_input", files.parse_hertz),
        (r"fan\d+_(input|min|max|target)", files.parse_rpm),
    )
)


def parser_for(attribute: str) -> Parse:
    """The parser for an amdgpu sysfs attribute by its file name (`temp1_input`,
    `pp_dpm_sclk`, `gpu_od/fan_ctrl/fan_curve`); every parser takes (data, file).
    Raises KeyError for a file kind we do not know."""
    base = attribute.rsplit("/", 1)[-1]
    for pattern, parse in _PARSERS:
        if pattern.match(base):
            return parse
    raise KeyError(f"no parser for amdgpu attribute {attribute!r}")
