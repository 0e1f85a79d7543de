"""Which processes hold each GPU: DRM clients from /proc/<pid>/fdinfo (the
kernel's DRM client usage stats, Documentation/gpu/drm-usage-stats.rst: `key:<ws>value
[unit]`, `drm-pdev` the PCI address, `drm-client-id` one per open DRM file, so dup'd fds
count once; amdgpu prints `drm-memory-vram`, `drm-engine-gfx: N ns` and `amd-*` keys —
what amdgpu_top reads) and NVML's running-process lists for NVIDIA GPUs.

Blocking /proc reads: call `scan` in a worker thread. The proc root is injectable: the
simulated host serves fdinfo for its simulated engines' processes under its own tree."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_LINE = re.compile(r"^([^:\s]+):\s*(\S.*?)\s*$")


@dataclass(frozen=True)
class DrmClient:
    """One DRM file's usage, as fdinfo shows it."""

    driver: str
    pdev: str | None
    client_id: str | None
    memory: Mapping[str, int]  # region -> bytes (drm-memory-*, else drm-resident-*/drm-total-*)
    engines_ns: Mapping[str, int]  # engine -> busy nanoseconds (drm-engine-*)
    extra: Mapping[str, str] = field(default_factory=dict)  # driver-specific keys (amd-*, pasid)

    @property
    def vram_bytes(self) -> int | None:
        return self.memory.get("vram")


def _amount(value: str) -> int | None:
    parts = value.split()
    if not parts or not parts[0].isdigit():
        return None
    unit = parts[1] if len(parts) > 1 else ""
    return int(parts[0]) * UNITS[unit] if unit in UNITS else None


def parse_fdinfo(text: str) -> DrmClient | None:
    """A /proc/PID/fdinfo/FD text -> DrmClient, or None when it is not a DRM file (no
    mandatory `drm-driver` key)."""
    kv: dict[str, str] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            kv[m.group(1)] = m.group(2)
    driver = kv.get("drm-driver")
    if not driver:
        return None
    legacy: dict[str, int] = {}
    resident: dict[str, int] = {}
    total: dict[str, int] = {}
    engines: dict[str, int] = {}
    extra: dict[str, str] = {}
    for key, value in kv.items():
        if key.startswith("drm-memory-"):
            if (n := _amount(value)) is not None:
                legacy[key[len("drm-memory-"):]] = n
        elif key.startswith("drm-resident-"):
            if (n := _amount(value)) is not None:
                resident[key[len("drm-resident-"):]] = n
        elif key.startswith("drm-total-"):
            if (n := _amount(value)) is not None:
                total[key[len("drm-total-"):]] = n
        elif key.startswith("drm-engine-") and not key.startswith("drm-engine-capacity-"):
            parts = value.split()
            if parts and parts[0].isdigit() and (len(parts) == 1 or parts[1] == "ns"):
                engines[key[len("drm-engine-"):]] = int(parts[0])
        elif not key.startswith("drm-") and key not in ("pos", "flags", "mnt_id", "ino"):
            extra[key] = value
    # drm-memory-<region> is the legacy spelling of drm-resident-<region> (drm-usage-stats)
    memory = {**total, **resident, **legacy}
    return DrmClient(driver, kv.get("drm-pdev"), kv.get("drm-client-id"), MappingProxyType(memory),
                     MappingProxyType(engines), MappingProxyType(extra))


@dataclass(frozen=True)
class GpuProcess:
    """One process's hold on one GPU."""

    pid: int
    comm: str
    bdf: str
    vram_bytes: int | None
    engines_ns: Mapping[str, int]
    source: str  # fdinfo | nvml

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "comm": self.comm, "bdf": self.bdf, "vram_bytes": self.vram_bytes,
                "engines_ns": dict(self.engines_ns), "source": self.source}


def _comm(proc: Path, pid: int) -> str:
    for root in (proc, Path("/proc")):
        try:
            return (root / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
    return "?"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def scan_fdinfo(proc: Path = Path("/proc"), pids: Iterable[int] | None = None) -> list[GpuProcess]:
    """Every process holding a DRM file, per GPU; VRAM summed over its distinct clients."""
    proc = Path(proc)
    if pids is None:
        try:
            pids = [int(d) for d in os.listdir(proc) if d.isdigit()]
        except OSError:
            return []
    out: list[GpuProcess] = []
    for pid in pids:
        if proc != Path("/proc") and not _alive(pid):
            continue  # a served tree keeps files of processes that are gone; /proc does not
        fdinfo = proc / str(pid) / "fdinfo"
        try:
            fds = os.listdir(fdinfo)
        except OSError:
            continue  # gone, or not ours to read
        per_gpu: dict[str, dict[str, DrmClient]] = {}
        for fd in fds:
            try:
                target = os.readlink(proc / str(pid) / "fd" / fd)
            except OSError:
                continue
            if not target.startswith("/dev/dri/"):
                continue
            try:
                client = parse_fdinfo((fdinfo / fd).read_text())
            except OSError:
                continue
            if client is None or client.pdev is None:
                continue
            per_gpu.setdefault(client.pdev, {})[client.client_id or f"fd{fd}"] = client
        for bdf, clients in per_gpu.items():
            vram = [c.vram_bytes for c in clients.values() if c.vram_bytes is not None]
            engines: dict[str, int] = {}
            for c in clients.values():
                for k, v in c.engines_ns.items():
                    engines[k] = engines.get(k, 0) + v
            out.append(GpuProcess(pid, _comm(proc, pid), bdf, sum(vram) if vram else None,
                                  MappingProxyType(engines), "fdinfo"))
    return out


def scan_nvml(nvml_source: Any, proc: Path = Path("/proc")) -> list[GpuProcess]:
    """NVIDIA GPUs: NVML's compute and graphics process lists (gpuguard.hw.nvml)."""
    out = []
    for dev in nvml_source.discover():
        for pid, mem in nvml_source.processes(dev).items():
            out.append(GpuProcess(pid, _comm(proc, pid), dev.bdf, mem, MappingProxyType({}), "nvml"))
    return out


class GpuAttribution:
    """The scans the watchdog runs: fdinfo under `proc`, plus NVML when given."""

    def __init__(self, proc: Path = Path("/proc"), nvml_source: Any = None,
                 gpu_names: Callable[[], Mapping[str, str]] | None = None) -> None:
        self.proc = Path(proc)
        self.nvml = nvml_source
        self.gpu_names = gpu_names or (lambda: {})  # bdf -> configured GPU name

    def scan(self) -> list[GpuProcess]:
        found = scan_fdinfo(self.proc)
        if self.nvml is not None:
            try:
                found += scan_nvml(self.nvml, self.proc)
            except Exception:  # noqa: BLE001 - NVML trouble is the poller's to report
                pass
        return found

    def name(self, bdf: str) -> str:
        return self.gpu_names().get(bdf, bdf)
