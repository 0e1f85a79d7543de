"""The GPU sources the poller reads, one per vendor: amdgpu through sysfs, NVIDIA
through NVML (when nvidia-ml-py and a driver are present). Each wraps its hardware
module behind the poller's two blocking calls, `discover()` and `read(dev, name)`."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.state.snapshot import GpuSnapshot

log = logging.getLogger("gpuguard.hw")

BOUND = "/sys/bus/pci/drivers/amdgpu"  # one entry per device the driver is bound to


class AmdgpuSource:
    name = "amdgpu"

    def __init__(self, root: SysfsRoot) -> None:
        self.root = root
        self._bound_at_discover: tuple[str, ...] | None = None
        self._hwmon: dict[str, str] = {}  # bdf -> the hwmon folder it had (cards found at the last discovery)

    def _bound(self) -> tuple[str, ...] | None:
        try:
            return tuple(self.root.listdir(BOUND))
        except SysfsError:
            return None

    def unchanged(self) -> bool:
        """True when the devices bound to amdgpu are the ones of the last `discover()`:
        one directory listing instead of a walk of every PCI device (at 32 GPUs the walk
        cost 11 ms every 5 s, a third of an idle daemon's CPU). A card that comes, goes or
        is rebound changes the listing; a renumbered hwmon or a card that stops answering
        asks the poller for a full discovery itself."""
        key = self._bound()
        return key is not None and key == self._bound_at_discover

    def discover(self) -> Sequence[Any]:
        from gpuguard.hw import amdgpu

        key = self._bound()  # before the walk: a change during it shows at the next look
        devs = [self._hwmon_kept(d) for d in amdgpu.discover(self.root)]
        self._hwmon = {d.bdf: d.hwmon_path or d.hwmon_gone for d in devs if d.hwmon_path or d.hwmon_gone}
        self._bound_at_discover = key
        return devs

    def _hwmon_kept(self, dev: Any) -> Any:
        """A card whose hwmon folder an earlier discovery found and this one did not (moved
        away, its driver half gone) reads it as an error, not as a card without sensors."""
        had = self._hwmon.get(dev.bdf)
        return dataclasses.replace(dev, hwmon_gone=had) if dev.hwmon_path is None and had else dev

    def read(self, dev: Any, name: str) -> GpuSnapshot:
        from gpuguard.hw import amdgpu

        return amdgpu.read_gpu(self.root, dev, name)


def default_sources(root: SysfsRoot, nvidia: bool = True) -> list[Any]:
    sources: list[Any] = [AmdgpuSource(root)]
    if nvidia and root.root == "/":
        # NVML talks to the real driver, not to a sysfs tree: only on the real root.
        try:
            from gpuguard.hw.nvml import NvmlSource

            src = NvmlSource.open()
            if src is not None:
                sources.append(src)
        except ImportError:
            pass
    return sources
