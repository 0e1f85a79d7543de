"""The links seen slow while their GPU worked: (gpu, upper, lower) -> (when, GT/s). A link
that idles slow is power saving, one that ran slow under load is a fault, and it stays one
while the GPU idles until the link is seen at full speed. The daemon keeps it
in its state dir so `gpuguard doctor` judges a hop by the same history; entries from
before the last boot are dropped (the link trained again at boot)."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Mapping

from gpuguard.hw.pcie_model import PcieReport
from gpuguard.hw.sysfs import SysfsError, SysfsRoot

FILE = "pcie-load-history.json"
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
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a full or read-only disk must not stop the watch
        log.warning("cannot save the PCIe load history to %s: %s; it stays in memory", path, e.strerror)
