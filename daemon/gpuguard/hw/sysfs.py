"""The one door to hardware files: every sysfs/procfs read and write goes through a
`SysfsRoot`, rooted at a directory (`/` on a real host, a simulated tree in tests and
the demo). Nothing else in gpuguard opens `/sys/...` literally.

Reads are one raw `os.read` per attribute: some hwmon drivers answer buffered reads with
EAGAIN, and a sysfs show() returns the whole value on the first read anyway. A file read
many times a second is held open and read with one `pread` (`HeldAttribute`). A failed read
raises `SysfsError` naming the file and the errno; callers record it as an error for that
value, never as a zero.
"""
from __future__ import annotations

import errno as errno_mod
import os
import re
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
        # Reads join by concatenation: os.path.join was a quarter of gpuguard's cost over
        # a bare os.read loop. Not a cache of joined paths: the PCIe walk reads ~3 800
        # distinct files at 32 GPUs and a cache held them all (0.7 MiB, issue 15).
        self._prefix = self.root.rstrip("/") + "/"

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
        try:
            fd = os.open(self._prefix + rel.lstrip("/"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO) from None
        try:
            return os.read(fd, READ_SIZE)
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO) from None
        finally:
            os.close(fd)

    def held(self, rel: str) -> "HeldAttribute":
        """`rel` kept open for repeated reads (hw/power_sampler.py: 20 reads a second)."""
        return HeldAttribute(self, rel)

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


# A sysfs attribute's show() writes at most one page.
ATTRIBUTE_SIZE = 4096
# Filesystems that render a file anew for every read at offset 0: sysfs and procfs
# (kernfs, seq_file), and FUSE (the simulator serves kernfs semantics, sim/fuse.py).
RERENDERING = ("sysfs", "proc", "fuse")


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the filesystem `path` lies on ('fuse' for any FUSE filesystem), '' when
    it cannot be told."""
    real = os.path.realpath(path)
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return "fuse" if kind.startswith("fuse") else kind


class HeldAttribute:
    """One attribute kept open and read again with `pread` at offset 0: kernfs renders a
    sysfs attribute anew for every read at offset 0 (seq_file restarts), so a held file
    costs one syscall a read where open/read/close cost three, and the open's walk down a
    sysfs path of a dozen components is most of that (issue 15: the power sampler reads
    every GPU 20 times a second). Owned by one thread; `close()` when done.

    A file that is gone answers ENODEV (kernfs) and is reopened by path on the next read.
    On a filesystem that does not render anew (a tree of plain files, replaced by rename
    as `gpuguard demo --write-tree` does) each read first looks whether the held file is
    still the one at its path (its link count), and reopens it when not."""

    def __init__(self, root: SysfsRoot, rel: str) -> None:
        self.rel = rel
        self._path = root.path(rel)
        self.rerenders = filesystem_type(self._path) in RERENDERING
        self._fd: int | None = None

    def read(self) -> bytes:
        fd = self._fd
        if fd is not None and not self.rerenders and os.fstat(fd).st_nlink == 0:
            self.close()  # replaced or removed: read what is at the path now
            fd = None
        if fd is None:
            try:
                fd = self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise SysfsError(self.rel, e.errno or errno_mod.EIO) from None
        try:
            return os.pread(fd, ATTRIBUTE_SIZE, 0)
        except OSError as e:
            self.close()
            raise SysfsError(self.rel, e.errno or errno_mod.EIO) from None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
