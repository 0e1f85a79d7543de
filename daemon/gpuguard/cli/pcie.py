"""`gpuguard pcie`: each GPU's PCIe path drawn as a tree (root port at the top, the GPU at
the bottom, the narrowest and downgraded hops marked), then the GPU-pair table, BARs and
root-port AtomicOps; `--json` prints the report's document (schema: docs/pcie.schema.json);
`--capture FILE` writes the plain-text capture of this host's PCI tree
(gpuguard.hw.pcie_capture) instead; `--replay FILE` reads a capture instead of the host."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import TextIO

from gpuguard.document import document
from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_model import GpuPath, PcieHop, PcieReport, format_gbps, format_speed
from gpuguard.hw.pcie_capture import CaptureError, capture, replay
from gpuguard.hw.sysfs import SysfsError, SysfsRoot

BUSY_PERCENT = 20  # gpu_busy_percent at or above this counts as working

ROLE_NAMES = {
    "root_port": "root port",
    "switch_upstream": "switch upstream",
    "switch_downstream": "switch downstream",
    "card_upstream": "card upstream",
    "card_downstream": "card downstream",
    "gpu": "GPU",
    "endpoint": "endpoint",
    "bridge": "bridge",
    "unknown": "unknown",
}


def add_source_args(p) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--sysfs-root", metavar="DIR", default=None,
                   help="read hardware below DIR (default /; doctor: the sysfs_root of --config)")
    p.add_argument("--replay", metavar="FILE", help="read a PCIe capture file instead of the host")
    p.add_argument("--busy", action="store_true",
                   help="treat every GPU as working (a slower link is then a finding, not power saving)")
    p.add_argument("--kernel-log", metavar="FILE", help="kernel log text (dmesg) for 'Detected VRAM' and P2P lines")


def register(subparsers) -> None:
    p = subparsers.add_parser("pcie", help="PCIe path, narrowest hop, BARs and P2P of every GPU", description=__doc__)
    add_source_args(p)
    p.add_argument("--capture", metavar="FILE", help="write a capture of this host's PCI tree to FILE and exit")
    p.add_argument("--all-devices", action="store_true", help="with --capture: every PCI function, not only GPU paths")
    p.set_defaults(func=run)


def busy_map(root: SysfsRoot, all_busy: bool) -> dict[str, bool]:
    """GPU busy flags from amdgpu's gpu_busy_percent (NVIDIA has none in sysfs)."""
    out = {}
    for bdf in root.listdir("/sys/bus/pci/devices"):
        if all_busy:
            out[bdf] = True
            continue
        try:
            out[bdf] = root.read_int(f"/sys/bus/pci/devices/{bdf}/gpu_busy_percent") >= BUSY_PERCENT
        except (SysfsError, ValueError):
            pass
    return out


def read_kernel_log(path: str | None) -> list[str]:
    if not path:
        return []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError as e:
        raise OSError(f"cannot read kernel log {path}: {e.strerror}") from None


class Source:
    """The tree to read: the host, a --sysfs-root, or a replayed capture (temp dir)."""

    def __init__(self, args) -> None:
        self._tmp = None
        if getattr(args, "replay", None):
            self._tmp = tempfile.TemporaryDirectory(prefix="gpuguard-replay-")
            replay(args.replay, self._tmp.name)
            self.root = SysfsRoot(self._tmp.name)
        else:
            self.root = SysfsRoot(args.sysfs_root or "/")

    def close(self) -> None:
        if self._tmp:
            self._tmp.cleanup()


def load(args, saved_kernel_lines: str | None = None) -> tuple[Source, PcieReport, list[str]]:
    """The walk and its kernel lines: --kernel-log's, then those the daemon saved in its
    state folder (`saved_kernel_lines`, policy/link_history.py; this boot's only)."""
    src = Source(args)
    lines = read_kernel_log(args.kernel_log)
    if saved_kernel_lines:
        from gpuguard.policy.link_history import boot_time, load_kernel_lines

        lines += [ln for ln in load_kernel_lines(saved_kernel_lines, boot_time(src.root)) if ln not in lines]
    report = walk(src.root, busy_map(src.root, args.busy), kernel_lines=lines, vram=nvml_vram(src.root))
    return src, report, lines


def nvml_vram(root: SysfsRoot) -> dict[str, int]:
    """VRAM sizes of NVIDIA GPUs from NVML, on the real host only (a tree or a replayed
    capture has no driver behind it)."""
    if root.root != "/":
        return {}
    try:
        from gpuguard.hw.nvml import NvmlSource
    except ImportError:
        return {}
    try:
        src = NvmlSource.open()
        return src.vram_totals() if src is not None else {}
    except Exception:
        return {}


def run(args) -> int:
    if args.capture:
        try:
            s = capture(SysfsRoot(args.sysfs_root or "/"), args.capture, all_devices=args.all_devices)
        except OSError as e:
            print(f"gpuguard pcie: cannot write {args.capture}: {e.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {args.capture}: {s.devices} PCI functions, {s.files} files, {s.links} links, "
              f"{s.errors} unreadable")
        if s.devices == 0:
            print("no GPU found: nothing on a GPU path to capture; --all-devices captures every PCI function")
        return 0
    try:
        src, report, _ = load(args)
    except (CaptureError, OSError) as e:
        print(f"gpuguard pcie: {e}", file=sys.stderr)
        return 1
    try:
        if args.json:
            json.dump(document(report), sys.stdout, indent=2)
            print()
        else:
            render(report, sys.stdout)
    finally:
        src.close()
    return 0 if report.gpus else 1  # no GPU is a warning, as in `gpuguard doctor` (exit 1)


# ------------------------------------------------------------------ rendering


class Style:
    def __init__(self, stream: TextIO) -> None:
        enc = (getattr(stream, "encoding", None) or "").lower()
        self.unicode = enc.startswith("utf")
        self.colour = stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
        self.branch = "└─ " if self.unicode else "`- "
        self.arrow = "→" if self.unicode else "->"
        self.pair = "↔" if self.unicode else "<->"
        self.mark = "◀" if self.unicode else "<=="

    def paint(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour else text


def _speeds(h: PcieHop) -> str:
    if h.current_speed_gts is None and h.max_speed_gts is None and h.current_width is None:
        return "link unknown"
    cw = f"x{h.current_width}" if h.current_width else "x?"
    mw = f"x{h.max_width}" if h.max_width else "x?"
    return f"{format_speed(h.current_speed_gts)}/{format_speed(h.max_speed_gts)} GT/s {cw}/{mw}"


def _hop_note(g: GpuPath, i: int, h: PcieHop, st: Style) -> str:
    lk = h.link
    notes = []
    if lk is None:
        parent = g.hops[i - 1].role if i > 0 else None
        if parent in ("switch_upstream", "card_upstream"):
            whose = "card's" if parent == "card_upstream" else "switch's"
            notes.append(st.paint(f"on the {whose} internal bus", "2"))
    elif lk.kind == "switch_internal":
        notes.append(st.paint("switch-internal: mirror values, not a link", "2"))
    else:
        bw = format_gbps(lk.bytes_per_second)
        notes.append(bw)
        if lk.kind == "card_internal":
            notes.append(st.paint("card-internal link", "2"))
        elif i == g.slot_link:
            notes.append("slot link")
    marks = []
    if i == g.narrowest:
        lim = f", limited by {lk.limited_by}" if lk and lk.limited_by else ""
        marks.append(st.paint(f"{st.mark} NARROWEST{lim}", "1;33"))
    if lk is not None and lk.counts and lk.downgraded:
        can = f"{format_speed(lk.capable_speed_gts)} GT/s x{lk.capable_width or '?'}"
        real = lk.downgraded_width or g.speed_drop_is_real(lk.current_speed_gts)
        idle = "" if real else " (GPU idle: may be power saving)"
        marks.append(st.paint(f"DOWNGRADED: both ends can {can}{idle}", "1;31"))
    if h.role_inferred:
        notes.append(st.paint("role inferred", "2"))
    if h.errors:
        notes.append(st.paint("unreadable: " + ", ".join(sorted(h.errors)), "33"))
    return "  ".join(notes + marks)


def render_gpu(g: GpuPath, out: TextIO, st: Style) -> None:
    ids = f"{g.vendor or '????'}:{g.device or '????'}"
    numa = f"NUMA {g.numa_node}" if g.numa_node is not None else "NUMA ?"
    busy = "busy" if g.busy else "idle/unknown load"
    out.write(st.paint(f"GPU {g.bdf}", "1") + f"  {ids}  {g.driver or 'no driver'}  {numa}  {g.root_complex}  {busy}\n")
    lk = g.narrowest_link
    if lk is None:
        out.write("  narrowest hop: unknown (no link attributes readable)\n")
    else:
        down = "  DOWNGRADED" if lk.downgraded else ""
        out.write(
            f"  narrowest hop: {lk.upper} {st.arrow} {lk.lower}  "
            f"{format_speed(lk.current_speed_gts)} GT/s x{lk.current_width or '?'} = {format_gbps(lk.bytes_per_second)}{down}\n"
        )
    # The tree on the left, then aligned columns: role, ids, current/max, the link's notes.
    lefts = [("  " + ("  " * (i - 1) + st.branch if i else "") + h.bdf) for i, h in enumerate(g.hops)]
    lw = max((len(x) for x in lefts), default=0)
    rw = max((len(ROLE_NAMES.get(h.role, h.role)) for h in g.hops), default=8)
    for i, h in enumerate(g.hops):
        role = ROLE_NAMES.get(h.role, h.role).ljust(rw)
        line = f"{lefts[i].ljust(lw)}  {role}  {h.ids}  {_speeds(h):<23} {_hop_note(g, i, h, st)}"
        out.write(line.rstrip() + "\n")


def render(report: PcieReport, out: TextIO) -> None:
    st = Style(out)
    if not report.gpus:
        out.write("no GPU found (no PCI display-class device of AMD, NVIDIA or Intel)\n")
    for g in report.gpus:
        render_gpu(g, out, st)
        out.write("\n")
    if report.pairs:
        out.write(st.paint("GPU pairs", "1") + "\n")
        for p in report.pairs:
            out.write(f"  {p.a} {st.pair} {p.b}  {p.meet:<11} P2P {p.p2p_text:<7}  {p.verdict}\n")
        out.write("\n")
    if report.gpus:
        out.write(st.paint("BARs and AtomicOps", "1") + "\n")
    for g in report.gpus:
        bars = "  ".join(
            f"BAR{b.index} {_size(b.size_bytes)}{' 64-bit' if b.is_64bit else ''}{' pref' if b.prefetchable else ''}"
            for b in g.bars
        ) or "no memory BARs readable"
        lb = g.large_bar_note
        if g.large_bar is False:
            lb = st.paint(lb, "1;31")
        out.write(f"  {g.bdf}  {bars}  {lb}\n")
        rp = g.root_port
        atom = g.root_port_atomics.describe() if g.root_port_atomics else g.root_port_atomics_note
        out.write(f"  {'':12}  AtomicOps at root port {rp.bdf if rp else '?'}: {atom}\n")
    if report.nvswitches:
        out.write(f"\nNVSwitch functions: {', '.join(report.nvswitches)} (NVLink may connect GPUs beside PCIe)\n")
    for p in report.problems:
        out.write(f"problem: {p}\n")


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"
