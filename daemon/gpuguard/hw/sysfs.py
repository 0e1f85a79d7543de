"""The one door to hardware files: every sysfs/procfs read and write goes through a
`SysfsRoot`, rooted at a directory (`/` on a real host, a simulated tree in tests and
the demo). Nothing else in gpuguard opens `/sys/...` literally.

Reads are one raw `os.read` per attribute: some hwmon drivers answer buffered reads with
EAGAIN, and a sysfs show() returns the whole value on the first read anyway. A failed read
raises `SysfsError` naming the file and the errno; callers record it as an error for that
value, never as a zero.
"""
from __future__ import annotations

import errno as errno_mod
import os
from dataclasses import dataclass

# sysfs show() output is at most one page; some attributes (pp_od_clk_voltage with NUL
# gaps, pp_power_profile_mode) come close, so read generously.
READ_SIZE = 65536


@dataclass
class SysfsError(Exception):
    """A hardware file could not be read or written. `path` is the path under the root."""

    path: str
    errno: int
    op: str = "read"

    def __str__(self) -> str:
        name = errno_mod.errorcode.get(self.errno, str(self.errno))
        return f"{self.op} {self.path}: {name} ({os.strerror(self.errno)})"

    @property
    def gone(self) -> bool:
        """The device behind the file is gone (lost from the bus, removed)."""
        return self.errno in (errno_mod.ENODEV, errno_mod.ENOENT, errno_mod.ENXIO)


class SysfsRoot:
    """Reads and writes hardware files below `root`. Paths are given as on a real host
    (`/sys/class/drm`, `sys/bus/pci/devices/0000:03:00.0/config`); a leading slash is
    optional."""

    def __init__(self, root: str = "/") -> None:
        self.root = os.path.abspath(root)
        # Joined paths, cached: a poll reads the same few dozen files every cycle and the
        # join was a quarter of gpuguard's cost over a bare os.read loop.
        self._joined: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"SysfsRoot({self.root!r})"

    def path(self, rel: str) -> str:
        rel = rel.lstrip("/")
        return os.path.join(self.root, rel) if rel else self.root

    def unroot(self, absolute: str) -> str:
        """The host-style path (`/sys/...`) of an absolute path below the root."""
        rel = os.path.relpath(absolute, self.root)
        return "/" + rel if rel != "." else "/"

    def read_bytes(self, rel: str) -> bytes:
        p = self._joined.get(rel)
        if p is None:
            p = self._joined[rel] = self.path(rel)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO) from None
        try:
            return os.read(fd, READ_SIZE)
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO) from None
        finally:
            os.close(fd)

    def read_text(self, rel: str) -> str:
        """The file's text with NUL bytes dropped (real amdgpu output has NUL runs, see
        reference/amdgpu/SOURCES.md) and surrounding whitespace stripped."""
        data = self.read_bytes(rel)
        if b"\0" in data:
            data = data.replace(b"\0", b"")
        return data.decode("utf-8", "replace").strip()

    def read_int(self, rel: str) -> int:
        """An integer attribute. Garbage raises ValueError naming the file."""
        text = self.read_text(rel)
        try:
            return int(text, 0) if text.startswith("0x") else int(text)
        except ValueError:
            raise ValueError(f"{rel}: expected an integer, read {text[:40]!r}") from None

    def write_text(self, rel: str, value: str) -> None:
        """One `write()` of `value` (one command per write, as amdgpu expects)."""
        p = self.path(rel)
        data = value.encode()
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "write") from None
        try:
            n = os.write(fd, data)
            if n != len(data):
                raise SysfsError(rel, errno_mod.EIO, "write")
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "write") from None
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        """Directory entries, sorted; a missing directory is an empty list."""
        try:
            return sorted(os.listdir(self.path(rel)))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "list") from None

    def realpath(self, rel: str) -> str:
        """The host-style canonical path of `rel` (symlinks followed, kept inside root)."""
        return self.unroot(os.path.realpath(self.path(rel)))

    def readlink_name(self, rel: str) -> str | None:
        """Last component of a symlink's target (`driver` -> `amdgpu`), None if absent."""
        try:
            return os.path.basename(os.readlink(self.path(rel)))
        except OSError:
            return None
