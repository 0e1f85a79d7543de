"""What the daemon learned about the PCIe paths that a walk cannot read again, kept in its
state dir so a restarted daemon and `gpuguard doctor` judge by the same facts; entries from
before the last boot are dropped (the links trained again, the driver probed again).

- The links seen slow while their GPU worked: (gpu, upper, lower) -> (when, GT/s). A link
  that idles slow is power saving, one that ran slow under load is a fault, and it stays
  one while the GPU idles until the link is seen at full speed.
- The kernel's lines about them (`KernelLines`): a P2P refusal, a `Detected VRAM` figure.
  The kernel prints each once; a restarted daemon resumes the log after it (kernel/kmsg.py)
  and doctor has no log unless given one, so without this the refusal was the pair's
  verdict only in the process that read it (INCIDENTS §5)."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Mapping

from gpuguard.hw.pcie_model import PcieReport
from gpuguard.hw.sysfs import SysfsError, SysfsRoot

FILE = "pcie-load-history.json"
KERNEL_FILE = "pcie-kernel-lines.json"
KERNEL_LINES_KEPT = 4096  # distinct lines; a refusal per direction of 496 pairs is 992
log = logging.getLogger("gpuguard.pcie")
Key = tuple[str, str, str]


def boot_time(root: SysfsRoot) -> float | None:
    """`btime` of /proc/stat (seconds since the epoch), None when unreadable."""
    try:
        for line in root.read_text("/proc/stat").splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (SysfsError, ValueError, IndexError):
        pass
    return None


class LinkHistory:
    def __init__(self, path: str | None = None, booted: float | None = None) -> None:
        self.path = path
        self.seen: dict[Key, tuple[float, float]] = load(path, booted) if path else {}

    def update(self, report: PcieReport, now: float) -> None:
        before = dict(self.seen)
        for g in report.gpus:
            for h in g.hops:
                lk = h.link
                if lk is None or not lk.counts:
                    continue
                key = (g.bdf, lk.upper, lk.lower)
                if not lk.downgraded_speed:
                    self.seen.pop(key, None)  # seen at full speed: the fault is gone
                elif g.busy and lk.current_speed_gts:
                    self.seen[key] = (now, lk.current_speed_gts)
        if self.path and self.seen.keys() != before.keys():
            save(self.path, self.seen)


def load(path: str, booted: float | None = None) -> dict[Key, tuple[float, float]]:
    """The saved history; a missing or unreadable file is an empty history (it only ever
    adds a warning), entries older than `booted` are dropped."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        out = {}
        for e in doc.get("links", []):
            t = float(e["time"])
            if booted is None or t >= booted:
                out[(str(e["gpu"]), str(e["upper"]), str(e["lower"]))] = (t, float(e["gts"]))
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def save(path: str, seen: Mapping[Key, tuple[float, float]]) -> None:
    doc = {"schema": 1, "saved": time.time(), "links": [
        {"gpu": g, "upper": u, "lower": lo, "time": t, "gts": gts} for (g, u, lo), (t, gts) in sorted(seen.items())]}
    _save(path, doc, "the PCIe load history")


def _save(path: str, doc: dict, what: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a full or read-only disk must not stop the watch
        log.warning("cannot save %s to %s: %s; it stays in memory", what, path, e.strerror)


class KernelLines:
    """The kernel lines a walk reads (P2P refusals, `Detected VRAM`), in the order first
    seen. `add` runs on the loop (an event), `lines` and `flush` (the file write) in the
    walker's thread: a lock between them."""

    def __init__(self, path: str | None = None, booted: float | None = None) -> None:
        self.path = path
        self.seen: dict[str, float] = load_kernel_lines(path, booted) if path else {}
        self._lock = threading.Lock()
        self._dirty = False

    def lines(self) -> list[str]:
        with self._lock:
            return list(self.seen)

    def add(self, line: str, when: float) -> bool:
        """True when the line is new."""
        line = line.strip()
        with self._lock:
            if not line or line in self.seen:
                return False
            self.seen[line] = when
            while len(self.seen) > KERNEL_LINES_KEPT:
                del self.seen[next(iter(self.seen))]
            self._dirty = True
            return True

    def flush(self) -> None:
        """Save the lines if one came since the last save."""
        with self._lock:
            if not self._dirty or not self.path:
                return
            self._dirty = False
            doc = {"schema": 1, "saved": time.time(), "lines": [{"time": t, "text": ln} for ln, t in self.seen.items()]}
        _save(self.path, doc, "the kernel's PCIe lines")


def load_kernel_lines(path: str, booted: float | None = None) -> dict[str, float]:
    """{line: when} saved by the daemon; a missing or unreadable file is none, lines from
    before `booted` are dropped."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        out = {}
        for e in doc.get("lines", []):
            t = float(e["time"])
            if booted is None or t >= booted:
                out[str(e["text"])] = t
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
