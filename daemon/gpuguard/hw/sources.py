"""The GPU sources the poller reads, one per vendor: amdgpu through sysfs, NVIDIA
through NVML (when nvidia-ml-py and a driver are present). Each wraps its hardware
module behind the poller's two blocking calls, `discover()` and `read(dev, name)`."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.state.snapshot import GpuSnapshot

log = logging.getLogger("gpuguard.hw")


class AmdgpuSource:
    name = "amdgpu"

    def __init__(self, root: SysfsRoot) -> None:
        self.root = root

    def discover(self) -> Sequence[Any]:
        from gpuguard.hw import amdgpu

        return amdgpu.discover(self.root)

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
