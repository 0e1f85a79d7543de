"""The simulated host as a `SysfsRoot`, in process: every read and write goes through the
simulator's kernel-like file operations (`SimHost.read/write`, real errno), without a FUSE
mount — so these tests run anywhere, also without root."""
from __future__ import annotations

import errno as errno_mod

import pytest

from gpuguard.hw.sysfs import SysfsError, SysfsRoot


class SimRoot(SysfsRoot):
    def __init__(self, host) -> None:
        super().__init__("/")
        self.host = host

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.host.read("/" + rel.lstrip("/"))
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO) from None

    def write_text(self, rel: str, value: str) -> None:
        try:
            self.host.write("/" + rel.lstrip("/"), value.encode())
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "write") from None

    def exists(self, rel: str) -> bool:
        try:
            self.host.getattr("/" + rel.lstrip("/"), follow=True)
            return True
        except OSError:
            return False

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(self.host.readdir("/" + rel.lstrip("/")))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "list") from None


@pytest.fixture
def sim_root():
    return SimRoot
