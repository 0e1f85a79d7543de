"""Capture and replay of the PCI sysfs files the PCIe walker reads, as one plain-text,
diffable archive (the idea of node_exporter's sys.ttar, in a format of our own).

`capture(root, out)` records, for every GPU, every PCI function on its canonical path, the
host bridge of each root complex, and other GPU-vendor functions (NVSwitches, audio)
with their paths — or every PCI function with `all_devices=True`. `replay(file, dir)`
rebuilds a tree below `dir` that `SysfsRoot(dir)` reads like the original host. Only the
standard library and gpuguard are needed, so it runs on any host as
`PYTHONPATH=daemon python -m gpuguard.cli pcie --capture OUT`.

Format (version 1), line oriented, UTF-8:
    # gpuguard pcie capture v1              first line, exactly
    # any comment                           host, kernel, uid, time, scope
    link PATH -> TARGET                     a symlink (TARGET relative, as the kernel's)
    file PATH                               a text file; its lines follow, each as
    | LINE                                  "| " + the line (exact, trailing blanks kept)
    \\ no newline at end of file             after the last "| " line when it had none
    hex PATH SIZE                           a binary file (config space, NUL-padded text),
     OFFS: xx xx ... (16 bytes a line)      lspci -xxx style rows
    error PATH ERRNO-NAME                   the file exists but could not be read
PATH is relative to the root (`sys/devices/pci0000:00/0000:00:02.0/class`). Files that
do not exist on the host are simply absent; `error` entries are not recreated on replay
(a plain directory cannot fail a read), they document what the host refused.
"""
from __future__ import annotations

import datetime as _dt
import errno as errno_mod
import os
import platform
import re
from dataclasses import dataclass
from typing import Iterable

from gpuguard.hw.pcie import is_gpu
from gpuguard.hw.pci_address import CANONICAL_RE as BDF_RE, ROOT_BUS_RE, host_bridge
from gpuguard.hw.sysfs import SysfsError, SysfsRoot

MAGIC = "# gpuguard pcie capture v1"
BUS = "/sys/bus/pci/devices"
HEX_ROW_RE = re.compile(r"^ ([0-9a-f]{4,}): ((?:[0-9a-f]{2} ?){1,16})$")
NO_NEWLINE = "\\ no newline at end of file"

# Every attribute the walker, doctor and later readers may look at. Missing ones are
# normal (NVIDIA: no mem_info_*, no hwmon; VMs: no link attributes; AER needs a kernel
# with AER enabled).
DEVICE_ATTRS = (
    "class", "vendor", "device", "subsystem_vendor", "subsystem_device", "revision",
    "current_link_speed", "current_link_width", "max_link_speed", "max_link_width",
    "numa_node", "local_cpulist", "resource", "enable", "power_state",
    "aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal",
    "aer_rootport_total_err_cor", "aer_rootport_total_err_fatal", "aer_rootport_total_err_nonfatal",
)
GPU_ATTRS = (
    "boot_vga", "mem_info_vram_total", "mem_info_vis_vram_total", "gpu_busy_percent",
    "pp_dpm_pcie", "pp_od_clk_voltage", "power_dpm_force_performance_level",
)
HWMON_ATTRS = ("name", "power1_cap", "power1_cap_min", "power1_cap_max", "power1_cap_default")
BINARY_ATTRS = {"config"}
OTHER_FUNCTION_VENDORS = {"1002", "10de"}
# The standard header and capability list; the extended space (AER, ...) is not needed
# and would make a capture of an 8-GPU host megabytes of hex.
CONFIG_KEEP = 256


class CaptureError(ValueError):
    """A capture file that cannot be read back; the message names the line."""


@dataclass(frozen=True)
class CaptureSummary:
    devices: int
    files: int
    links: int
    errors: int


def _entries_for_file(rel: str, data: bytes) -> list[str]:
    text = None
    if rel.rsplit("/", 1)[-1] not in BINARY_ATTRS and b"\0" not in data and b"\r" not in data:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is None:
        out = [f"hex {rel} {len(data)}"]
        for off in range(0, len(data), 16):
            row = " ".join(f"{b:02x}" for b in data[off : off + 16])
            out.append(f" {off:04x}: {row}")
        return out
    out = [f"file {rel}"]
    if text:
        lines = text.split("\n")
        ended = lines[-1] == ""
        if ended:
            lines.pop()
        out.extend("| " + line for line in lines)
        if not ended:
            out.append(NO_NEWLINE)
    return out


class _Writer:
    def __init__(self, root: SysfsRoot) -> None:
        self.root = root
        self.lines: list[str] = []
        self.files = self.links = self.errors = 0
        self.done: set[str] = set()

    def file(self, host_path: str) -> None:
        if host_path in self.done:
            return
        self.done.add(host_path)
        rel = host_path.lstrip("/")
        try:
            data = self.root.read_bytes(host_path)
        except SysfsError as e:
            if e.errno in (errno_mod.ENOENT, errno_mod.ENOTDIR):
                return
            if e.errno == errno_mod.EISDIR:
                return
            self.lines.append(f"error {rel} {errno_mod.errorcode.get(e.errno, str(e.errno))}")
            self.errors += 1
            return
        if rel.endswith("/config") and len(data) > CONFIG_KEEP:
            self.lines.append(f"# config: {len(data)} bytes on the host, the first {CONFIG_KEEP} kept")
            data = data[:CONFIG_KEEP]
        self.lines.extend(_entries_for_file(rel, data))
        self.files += 1

    def link(self, host_path: str, target: str) -> None:
        if host_path in self.done:
            return
        self.done.add(host_path)
        self.lines.append(f"link {host_path.lstrip('/')} -> {target}")
        self.links += 1


def _chain(root: SysfsRoot, bdf: str) -> list[str]:
    """Host paths of every PCI function from the root bus down to `bdf`."""
    real = root.realpath(f"{BUS}/{bdf}")
    parts = real.strip("/").split("/")
    out = []
    for i, p in enumerate(parts):
        if BDF_RE.match(p):
            out.append("/" + "/".join(parts[: i + 1]))
    return out


def _read_hex(root: SysfsRoot, path: str) -> str | None:
    try:
        return root.read_text(path).lower()
    except SysfsError:
        return None


def capture_lines(root: SysfsRoot, *, all_devices: bool = False, note: str = "") -> tuple[list[str], CaptureSummary]:
    """The capture as a list of lines (see the module docstring)."""
    w = _Writer(root)
    bdfs = [b for b in root.listdir(BUS) if BDF_RE.match(b)]
    wanted: list[str] = []
    gpus: set[str] = set()
    for bdf in bdfs:
        cls = _read_hex(root, f"{BUS}/{bdf}/class") or ""
        vendor = (_read_hex(root, f"{BUS}/{bdf}/vendor") or "")[2:]
        driver = root.readlink_name(f"{BUS}/{bdf}/driver")
        if is_gpu(vendor, cls, driver):
            gpus.add(bdf)
        # Other functions of GPU vendors (NVSwitch 0x0680, HDMI audio) with their paths,
        # but not the vendors' bridges and not Intel's hundreds of uncore functions.
        other = vendor in OTHER_FUNCTION_VENDORS and not cls.startswith("0x0604")
        if all_devices or bdf in gpus or other:
            wanted.append(bdf)
    complexes: set[str] = set()
    device_paths: dict[str, str] = {}
    for bdf in wanted:
        real = root.realpath(f"{BUS}/{bdf}")
        for comp in real.strip("/").split("/"):
            if ROOT_BUS_RE.match(comp):
                complexes.add(comp)
        for p in _chain(root, bdf):
            device_paths[p.rsplit("/", 1)[-1]] = p
    for comp in sorted(complexes):
        hb = host_bridge(comp)
        if root.exists(f"{BUS}/{hb}"):
            device_paths.setdefault(hb, root.realpath(f"{BUS}/{hb}"))

    uid = os.geteuid() if hasattr(os, "geteuid") else -1
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    w.lines.append(MAGIC)
    w.lines.append(f"# host: {platform.node()}  kernel: {platform.release()}  uid: {uid}  created: {stamp}")
    w.lines.append(f"# scope: {'all PCI functions' if all_devices else 'GPU paths + host bridges'}; root: {root.root}")
    if note:
        w.lines.append(f"# note: {note}")
    if uid != 0:
        w.lines.append("# config space beyond 64 bytes needs root: AtomicOps and port types will read as unknown")
    # CPU 0's block of /proc/cpuinfo: p2pdma allows host-bridge P2P on AMD Zen CPUs, so a
    # replay must judge GPU pairs as the live host does (gpuguard.hw.pcie_p2p).
    try:
        cpu0 = root.read_bytes("/proc/cpuinfo").split(b"\n\n", 1)[0]
    except SysfsError:
        cpu0 = b""
    if cpu0:
        w.lines.append("# proc/cpuinfo: the first CPU's block only")
        w.lines.extend(_entries_for_file("proc/cpuinfo", cpu0 + b"\n"))
        w.files += 1
    for bdf in sorted(device_paths):
        path = device_paths[bdf]
        w.link(f"{BUS}/{bdf}", os.path.relpath(path, BUS))
        drv = root.readlink_name(f"{path}/driver")
        if drv:
            w.link(f"{path}/driver", os.path.relpath(f"/sys/bus/pci/drivers/{drv}", path))
        for attr in DEVICE_ATTRS:
            w.file(f"{path}/{attr}")
        w.file(f"{path}/config")
        if bdf in gpus:
            for attr in GPU_ATTRS:
                w.file(f"{path}/{attr}")
            try:
                hwmons = root.listdir(f"{path}/hwmon")
            except SysfsError as e:
                w.lines.append(f"error {path.lstrip('/')}/hwmon {errno_mod.errorcode.get(e.errno, str(e.errno))}")
                w.errors += 1
                hwmons = []
            for hw in hwmons:
                for attr in HWMON_ATTRS:
                    w.file(f"{path}/hwmon/{hw}/{attr}")
    return w.lines, CaptureSummary(len(device_paths), w.files, w.links, w.errors)


def capture(root: SysfsRoot, out: str, *, all_devices: bool = False, note: str = "") -> CaptureSummary:
    """Write the capture of `root`'s PCI tree to `out` (atomically: temp file + rename)."""
    lines, summary = capture_lines(root, all_devices=all_devices, note=note)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, out)
    return summary


@dataclass(frozen=True)
class _Entry:
    kind: str  # file | link | error
    path: str
    data: bytes = b""
    target: str = ""


def parse_capture(text: str, name: str = "<capture>") -> list[_Entry]:
    lines = text.split("\n")
    if not lines or lines[0].strip() != MAGIC:
        raise CaptureError(f"{name}:1: not a gpuguard pcie capture (first line must be {MAGIC!r})")
    entries: list[_Entry] = []
    i = 1
    n = len(lines)

    def where(k: int) -> str:
        return f"{name}:{k + 1}"

    while i < n:
        line = lines[i]
        if not line or line.startswith("#"):
            i += 1
            continue
        if line.startswith("link "):
            body = line[5:]
            if " -> " not in body:
                raise CaptureError(f"{where(i)}: link without ' -> TARGET'")
            path, target = body.split(" -> ", 1)
            entries.append(_Entry("link", _check_path(path, where(i)), target=target))
            i += 1
        elif line.startswith("file "):
            path = _check_path(line[5:], where(i))
            i += 1
            content: list[str] = []
            ended = True
            while i < n and (lines[i].startswith("| ") or lines[i] == "|" or lines[i] == NO_NEWLINE):
                if lines[i] == NO_NEWLINE:
                    ended = False
                    i += 1
                    break
                content.append(lines[i][2:])
                i += 1
            text_ = "\n".join(content) + ("\n" if content and ended else "")
            entries.append(_Entry("file", path, data=text_.encode("utf-8")))
        elif line.startswith("hex "):
            parts = line[4:].rsplit(" ", 1)
            if len(parts) != 2 or not parts[1].isdigit():
                raise CaptureError(f"{where(i)}: hex entry needs 'hex PATH SIZE'")
            path, size = _check_path(parts[0], where(i)), int(parts[1])
            i += 1
            buf = bytearray()
            while i < n and lines[i].startswith(" "):
                m = HEX_ROW_RE.match(lines[i])
                if not m or int(m.group(1), 16) != len(buf):
                    raise CaptureError(f"{where(i)}: bad hex row {lines[i][:60]!r}")
                buf.extend(bytes.fromhex(m.group(2)))
                i += 1
            if len(buf) != size:
                raise CaptureError(f"{name}: {path}: {len(buf)} bytes of hex, header says {size}")
            entries.append(_Entry("file", path, data=bytes(buf)))
        elif line.startswith("error "):
            parts = line[6:].rsplit(" ", 1)
            entries.append(_Entry("error", _check_path(parts[0], where(i)), target=parts[-1]))
            i += 1
        else:
            raise CaptureError(f"{where(i)}: unknown entry {line[:60]!r} (expected link/file/hex/error)")
    return entries


def _check_path(path: str, where: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CaptureError(f"{where}: path {path!r} must be relative and stay inside the tree")
    return path


def replay(capture_file: str, dest: str) -> list[str]:
    """Rebuild the captured tree below `dest`. Returns the paths recorded as unreadable
    (`error` entries), which are not recreated."""
    with open(capture_file, encoding="utf-8") as f:
        entries = parse_capture(f.read(), capture_file)
    return replay_entries(entries, dest)


def replay_entries(entries: Iterable[_Entry], dest: str) -> list[str]:
    dest = os.path.abspath(dest)
    skipped = []
    for e in entries:
        full = os.path.join(dest, e.path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if e.kind == "file":
            with open(full, "wb") as f:
                f.write(e.data)
        elif e.kind == "link":
            resolved = os.path.normpath(os.path.join(os.path.dirname(full), e.target))
            if not (resolved + "/").startswith(dest + "/"):
                raise CaptureError(f"link {e.path} -> {e.target} points outside the tree")
            if os.path.lexists(full):
                os.unlink(full)
            os.symlink(e.target, full)
        else:
            skipped.append(f"{e.path} ({e.target})")
    return skipped
