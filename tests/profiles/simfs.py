"""Test stand-in: serve a `SimHost` through a real FUSE mount (real errno on real
syscalls) and record every write, until `gpuguard.sim.fuse.mount` is on this branch —
then `mount_sim` uses that. Adds `/dev/kmsg` (the simulator's kernel log) and overlay
files (`/proc/cmdline`, boot id) the profile code reads."""
from __future__ import annotations

import errno
import itertools
import os
import stat
import subprocess
import threading
import time

import mfusepy


class SimFs(mfusepy.Operations):
    use_ns = True

    def __init__(self, host, overlay: dict[str, bytes] | None = None) -> None:
        self.host = host
        self.overlay = dict(overlay or {})
        self.writes: list[tuple[str, str, int]] = []  # (path, data, errno or 0) in order
        self.write_starts: list[tuple[float, str, str]] = []  # (wall time, path, data) as each write began
        self.started = threading.Event()  # set by init(), after libfuse's setup
        self.reads: dict[str, int] = {}  # basename of the device folder/file -> reads (to see a poller run)
        self._fh = itertools.count(1)
        self._cache: dict[int, bytes] = {}
        self._wlock = threading.Lock()

    def init(self, path):
        self.started.set()

    def _kmsg(self) -> bytes:
        return "".join(self.host.kmsg_lines()).encode()

    def _extra_dirs(self) -> set[str]:
        out = {"/dev"}
        for p in self.overlay:
            d = os.path.dirname(p)
            while d not in ("/", ""):
                out.add(d)
                d = os.path.dirname(d)
        return out

    def getattr(self, path, fh=None):
        now = time.time()
        base = {"st_uid": 0, "st_gid": 0, "st_atime": now, "st_mtime": now, "st_ctime": now, "st_nlink": 1}
        if path == "/dev/kmsg":
            return {**base, "st_mode": stat.S_IFREG | 0o644, "st_size": len(self._kmsg())}
        if path in self.overlay:
            return {**base, "st_mode": stat.S_IFREG | 0o644, "st_size": len(self.overlay[path])}
        if path in self._extra_dirs():
            return {**base, "st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        try:
            st = self.host.getattr(path, follow=False)
        except OSError as e:
            raise mfusepy.FuseOSError(e.errno or errno.EIO)
        kind = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "link": stat.S_IFLNK}[st.kind]
        return {**base, "st_mode": kind | st.mode, "st_size": st.size}

    def readdir(self, path, fh):
        extra = sorted({p[len(path.rstrip("/")) + 1:].split("/")[0] for p in list(self.overlay) + ["/dev/kmsg"]
                        if p.startswith(path.rstrip("/") + "/")})
        try:
            names = self.host.readdir(path)
        except OSError as e:
            if not extra:
                raise mfusepy.FuseOSError(e.errno or errno.EIO)
            names = []
        return [".", ".."] + sorted(set(names) | set(extra))

    def readlink(self, path):
        try:
            return self.host.readlink(path)
        except OSError as e:
            raise mfusepy.FuseOSError(e.errno or errno.EIO)

    def open(self, path, flags):
        if path != "/dev/kmsg" and path not in self.overlay:
            try:
                self.host.check_open(path, write=bool(flags & (os.O_WRONLY | os.O_RDWR)))
            except OSError as e:
                raise mfusepy.FuseOSError(e.errno or errno.EIO)
        return next(self._fh)

    def read(self, path, size, offset, fh):
        if path == "/dev/kmsg":
            return self._kmsg()[offset:offset + size]
        if path in self.overlay:
            return self.overlay[path][offset:offset + size]
        if offset == 0:
            key = "/".join(path.rsplit("/", 2)[-2:])
            self.reads[key] = self.reads.get(key, 0) + 1
        if offset == 0 or fh not in self._cache:
            try:
                self._cache[fh] = self.host.read(path)
            except OSError as e:
                raise mfusepy.FuseOSError(e.errno or errno.EIO)
        return self._cache[fh][offset:offset + size]

    def write(self, path, data, offset, fh):
        with self._wlock:  # when each write *began* (a write blocked in the device counts from here)
            self.write_starts.append((time.time(), path, bytes(data).decode(errors="replace")))
        try:
            n = self.host.write(path, bytes(data))
        except OSError as e:
            with self._wlock:
                self.writes.append((path, bytes(data).decode(errors="replace"), e.errno or errno.EIO))
            raise mfusepy.FuseOSError(e.errno or errno.EIO)
        with self._wlock:
            self.writes.append((path, bytes(data).decode(errors="replace"), 0))
        return n

    def truncate(self, path, length, fh=None):
        return 0

    def release(self, path, fh):
        self._cache.pop(fh, None)
        return 0


class Mounted:
    def __init__(self, host, mountpoint: str, overlay: dict[str, bytes] | None = None, tick: float = 0.05) -> None:
        self.host = host
        self.mountpoint = mountpoint
        self.fs = SimFs(host, overlay)
        self._stop = threading.Event()
        cwd = os.getcwd()
        self._thread = threading.Thread(
            target=mfusepy.FUSE, args=(self.fs, mountpoint),
            kwargs=dict(foreground=True, nothreads=False, direct_io=True, attr_timeout=0, entry_timeout=0,
                        negative_timeout=0, default_permissions=False),
            daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not os.path.ismount(mountpoint):
            if time.monotonic() > deadline:
                raise RuntimeError("FUSE mount did not come up")
            time.sleep(0.01)
        # libfuse's fuse_daemonize() does chdir("/") for the whole process; give the tests
        # their working directory back (wait for the FUSE loop to have started first).
        while not self.fs.started.wait(0.01):
            if time.monotonic() > deadline:
                break
        os.chdir(cwd)
        # The simulator's clock: late cards, resets and the load model advance with it.
        self._clock = threading.Thread(target=self._tick, args=(tick,), daemon=True)
        self._clock.start()

    def _tick(self, tick: float) -> None:
        while not self._stop.wait(tick):
            self.host.step(tick)

    def writes(self, ok_only: bool = True) -> list[str]:
        """`<file>: <value>` for every write, in order (LACT-style), with the GPU's bdf."""
        out = []
        with self.fs._wlock:
            for path, data, err in self.fs.writes:
                if ok_only and err:
                    continue
                out.append(f"{os.path.basename(path)}: {data.strip()}")
        return out

    def writes_by_gpu(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        with self.fs._wlock:
            for path, data, err in self.fs.writes:
                if err:
                    continue
                bdfs = [p for p in path.split("/") if p.count(":") == 2 and "." in p]
                bdf = bdfs[-1] if bdfs else "?"  # the device folder (the path is resolved)
                out.setdefault(bdf, []).append(f"{os.path.basename(path)}: {data.strip()}")
        return out

    def close(self) -> None:
        self._stop.set()
        self.host.release_all()
        if subprocess.run(["fusermount3", "-u", self.mountpoint], check=False, capture_output=True).returncode:
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], check=False, capture_output=True)
        self._thread.join(timeout=0.5)  # a lazily unmounted fs exits once its last fd closes
