"""Serve a SimHost as a real filesystem through FUSE (mfusepy), so a real process doing
real open/read/write gets the kernel's errno results and real symlinks.

    with mount(host, "/tmp/simroot"):      # background thread, unmounted on exit
        SysfsRoot("/tmp/simroot").read_text("/sys/class/drm/card1/device/gpu_busy_percent")

As a separate process (tests, demo):
    python -m gpuguard.sim.fuse MOUNTPOINT [--scenario incident] [--seed N]
        [--step-interval 0.5] [--control SOCKET]
It mounts, steps the model in real time, serves the control socket (control.py) and
unmounts cleanly on SIGTERM/SIGINT/SIGHUP or when unmounted from outside. Needs
/dev/fuse and fusermount3 (Debian `fuse3`) and, outside root, `user_allow_other` is not needed (the mount is private).

Semantics: direct_io and zero entry/attr/negative timeouts, so every read reaches the
model (a file that vanished is ENOENT on the next open at once); a read at offset 0
renders the attribute (sysfs show()), later offsets continue the same buffer; a read
through an fd whose file was removed meanwhile is ENODEV (kernfs). O_TRUNC is ignored,
like sysfs.

Tests mount in-process with `SimMount` (a started mount with `.close()`), which can add
files beside the sysfs tree (`extra`: `/proc/cmdline`, the boot id, `/dev/kmsg` as a plain
file of the simulated kernel log, which is what a profile apply reads for an EINVAL's
reason) and keeps a `WriteRecorder`: every write in the order it reached the model, with
its errno, and how often each file was read.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable

try:
    import mfusepy
except OSError as _e:
    # mfusepy loads libfuse when imported: on a host without it the module still imports
    # and fuse_available() says why, so callers (tests, the demo) skip or fall back
    # instead of failing at import.
    mfusepy = None
    _NO_LIBFUSE: str | None = f"libfuse cannot be loaded ({_e}); install the Debian package fuse3"
else:
    _NO_LIBFUSE = None

from gpuguard.hw.pci_address import bdf_in_path

from .host import SimHost
from .runner import SimRunner

FUSERMOUNT = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"


class WriteRecorder:
    """What reached the model through the mount, for tests (LACT's snapshot of writes):
    `writes` is (path, text, errno or 0) in the order the model answered, `write_starts`
    (wall time, path, text) as each write began (a write blocked in the device counts from
    there), `reads` counts reads at offset 0 per `<device folder>/<file>`. Read under `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writes: list[tuple[str, str, int]] = []
        self.write_starts: list[tuple[float, str, str]] = []
        self.reads: dict[str, int] = {}

    def read(self, path: str) -> None:
        key = "/".join(path.rsplit("/", 2)[-2:])
        with self.lock:
            self.reads[key] = self.reads.get(key, 0) + 1

    def begin(self, path: str, data: bytes) -> None:
        with self.lock:
            self.write_starts.append((time.time(), path, data.decode(errors="replace")))

    def end(self, path: str, data: bytes, err: int) -> None:
        with self.lock:
            self.writes.append((path, data.decode(errors="replace"), err))

    def lines(self, ok_only: bool = True) -> list[str]:
        """`<file>: <value>` for every write, in order."""
        with self.lock:
            return [f"{os.path.basename(p)}: {d.strip()}" for p, d, err in self.writes if not (ok_only and err)]

    def by_gpu(self) -> dict[str, list[str]]:
        """The accepted writes per PCI address (the device folder in the resolved path)."""
        out: dict[str, list[str]] = {}
        with self.lock:
            for path, data, err in self.writes:
                if err:
                    continue
                out.setdefault(bdf_in_path(path) or "?", []).append(f"{os.path.basename(path)}: {data.strip()}")
        return out


class SimFS(mfusepy.Operations if mfusepy is not None else object):  # type: ignore[misc]
    use_ns = True

    def __init__(self, host: SimHost, extra: dict | None = None, recorder: WriteRecorder | None = None) -> None:
        self.host = host
        # read-only files beside the model's tree; a callable is rendered at every read (a
        # log read through one fd sees what was appended since it was opened)
        self.extra: dict[str, bytes | Callable[[], bytes]] = extra if extra is not None else {}
        self.recorder = recorder
        self.fh = itertools.count(1)
        self.open_files: dict[int, tuple[str, bytes | None]] = {}
        self._lock = threading.Lock()
        self.mounted_at = int(time.time() * 1e9)
        self.started = threading.Event()  # set once libfuse has set up and serves requests

    def init(self, path):
        self.started.set()

    def _extra(self, path: str) -> bytes:
        v = self.extra[path]
        return v() if callable(v) else v

    def _extra_dirs(self) -> set[str]:
        out = set()
        for p in list(self.extra):
            d = os.path.dirname(p)
            while d not in ("/", ""):
                out.add(d)
                d = os.path.dirname(d)
        return out

    def _uid(self) -> int:
        try:
            return mfusepy.fuse_get_context()[0]
        except Exception:  # noqa: BLE001 - no context outside a request
            return 0

    @staticmethod
    def _err(e: OSError) -> OSError:
        return mfusepy.FuseOSError(e.errno or errno.EIO)

    def getattr(self, path, fh=None):
        t = self.mounted_at
        base = {"st_uid": 0, "st_gid": 0, "st_atime": t, "st_mtime": t, "st_ctime": t}
        if path in self.extra:
            return {**base, "st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": len(self._extra(path))}
        if path in self._extra_dirs():
            return {**base, "st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, "st_size": 0}
        try:
            st = self.host.getattr(path)
        except OSError as e:
            raise self._err(e) from None
        kind = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "link": stat.S_IFLNK}[st.kind]
        return {**base, "st_mode": kind | st.mode, "st_nlink": 2 if st.kind == "dir" else 1, "st_size": st.size}

    def readdir(self, path, fh):
        prefix = path.rstrip("/") + "/"
        extra = {p[len(prefix):].split("/")[0] for p in list(self.extra) if p.startswith(prefix)}
        try:
            names = self.host.readdir(path)
        except OSError as e:
            if not extra:
                raise self._err(e) from None
            names = []
        return [".", ".."] + names + sorted(extra - set(names))

    def readlink(self, path):
        try:
            return self.host.readlink(path)
        except OSError as e:
            raise self._err(e) from None

    def open(self, path, flags):
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if path in self.extra:
            if write:
                raise mfusepy.FuseOSError(errno.EACCES)
            fh = next(self.fh)
            with self._lock:
                self.open_files[fh] = (path, None)
            return fh
        try:
            self.host.check_open(path, write, uid=self._uid())
        except OSError as e:
            raise self._err(e) from None
        fh = next(self.fh)
        with self._lock:
            self.open_files[fh] = (path, None)
        return fh

    def read(self, path, size, offset, fh):
        with self._lock:
            path, buf = self.open_files.get(fh, (path, None))
        if path in self.extra:
            return self._extra(path)[offset:offset + size]
        if self.recorder is not None and offset == 0:
            self.recorder.read(path)
        if offset == 0 or buf is None:
            try:
                buf = self.host.read(path, uid=self._uid())
            except OSError as e:
                if e.errno == errno.ENOENT:
                    raise mfusepy.FuseOSError(errno.ENODEV) from None   # kernfs: fd outlived the file
                raise self._err(e) from None
            with self._lock:
                if fh in self.open_files:
                    self.open_files[fh] = (path, buf)
        return buf[offset:offset + size]

    def write(self, path, data, offset, fh):
        with self._lock:
            path = self.open_files.get(fh, (path, None))[0]
        data = bytes(data)
        if self.recorder is not None:
            self.recorder.begin(path, data)
        try:
            n = self.host.write(path, data, uid=self._uid())
        except OSError as e:
            err = errno.ENODEV if e.errno == errno.ENOENT else (e.errno or errno.EIO)
            if self.recorder is not None:
                self.recorder.end(path, data, err)
            raise mfusepy.FuseOSError(err) from None
        if self.recorder is not None:
            self.recorder.end(path, data, 0)
        return n

    def truncate(self, path, length, fh=None):
        if path in self.extra:
            raise mfusepy.FuseOSError(errno.EACCES)
        try:
            self.host.check_open(path, True, uid=self._uid())
        except OSError as e:
            raise self._err(e) from None
        return 0

    def release(self, path, fh):
        with self._lock:
            self.open_files.pop(fh, None)
        return 0

    def statfs(self, path):
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}


def fuse_available() -> str | None:
    """None when FUSE can be used here, else the reason it cannot."""
    if _NO_LIBFUSE is not None:
        return _NO_LIBFUSE
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not shutil.which("fusermount3") and not shutil.which("fusermount"):
        return "fusermount3 is not installed (Debian package fuse3)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no read/write access to /dev/fuse"
    return None


def _options() -> dict:
    opts = dict(foreground=True, nothreads=False, direct_io=True, entry_timeout=0, attr_timeout=0,
                negative_timeout=0, fsname="gpuguard-sim")
    if os.geteuid() == 0:
        opts["allow_other"] = True
    return opts


def unmount(mountpoint: str) -> bool:
    """Unmount; False when it was busy and only detached (lazily: it ends when its last fd closes)."""
    subprocess.run([FUSERMOUNT, "-u", mountpoint], check=False, capture_output=True)
    if os.path.ismount(mountpoint):
        subprocess.run([FUSERMOUNT, "-uz", mountpoint], check=False, capture_output=True)
        return False
    return True


class SimMount:
    """`host` served at `mountpoint` from a background thread of this process, mounted when
    the constructor returns; `close()` unmounts. `extra` adds read-only files beside the
    tree; `record=True` keeps a `WriteRecorder` (`.recorder`, `.writes()`); `tick` runs the
    model's clock in real time every `tick` seconds (a `SimRunner`: late cards, resets, the
    load model), None leaves it still."""

    def __init__(self, host: SimHost, mountpoint: str, extra: dict | None = None, record: bool = False,
                 tick: float | None = None, timeout: float = 10.0) -> None:
        reason = fuse_available()
        if reason:
            raise RuntimeError(f"cannot mount the simulated host: {reason}")
        self.host = host
        self.mountpoint = mountpoint
        self.recorder = WriteRecorder() if record else None
        self.fs = SimFS(host, extra, self.recorder)
        self._errors: list[BaseException] = []
        self._timeout = timeout
        os.makedirs(mountpoint, exist_ok=True)
        cwd = os.getcwd()
        self._thread = threading.Thread(target=self._serve, name=f"simfuse:{mountpoint}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        try:
            while not os.path.ismount(mountpoint):
                if self._errors or not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"FUSE mount of {mountpoint} failed: "
                                       f"{self._errors[0] if self._errors else 'timeout'}")
                time.sleep(0.01)
            # libfuse's setup may chdir("/") for the whole process: once it serves, give the
            # caller its working directory back
            self.fs.started.wait(max(0.0, deadline - time.monotonic()))
            if os.getcwd() != cwd:
                os.chdir(cwd)
        except BaseException:  # a failed mount, or Ctrl-C while mounting: leave no mount behind
            unmount(mountpoint)
            raise
        self._clock = SimRunner(host, interval=tick).start() if tick else None

    def _serve(self) -> None:
        try:
            mfusepy.FUSE(self.fs, self.mountpoint, **_options())
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._errors.append(e)

    def writes(self, ok_only: bool = True) -> list[str]:
        """`<file>: <value>` for every recorded write, in order (needs `record=True`)."""
        return self.recorder.lines(ok_only) if self.recorder else []

    def writes_by_gpu(self) -> dict[str, list[str]]:
        return self.recorder.by_gpu() if self.recorder else {}

    def close(self) -> None:
        if self._clock is not None:
            self._clock.stop()
        self.host.release_all()   # a read or write blocked in the model would hold the unmount
        if unmount(self.mountpoint):
            self._thread.join(self._timeout)
        else:
            self._thread.join(0.5)   # detached: its thread ends once the last fd closes


@contextlib.contextmanager
def mount(host: SimHost, mountpoint: str, timeout: float = 10.0):
    """Mount `host` at `mountpoint` in a background thread; unmount cleanly on exit."""
    m = SimMount(host, mountpoint, timeout=timeout)
    try:
        yield mountpoint
    finally:
        m.close()


def main(argv: list[str] | None = None) -> int:
    from .runner import SCENARIOS, SimRunner, build_scenario

    ap = argparse.ArgumentParser(prog="python -m gpuguard.sim.fuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--scenario", default="incident", choices=sorted(SCENARIOS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-interval", type=float, default=0.5, help="seconds between model steps (0: never)")
    ap.add_argument("--control", help="UNIX socket path for the control channel")
    ap.add_argument("--kmsg", metavar="FIFO",
                    help="deliver the simulated kernel log as kernel records through this FIFO (a daemon's "
                         "kernel.kmsg_path, sim/kmsg_pipe.py), and serve the control op kmsg(text, level?, bdf?)")
    args = ap.parse_args(argv)
    reason = fuse_available()
    if reason:
        print(f"gpuguard.sim.fuse: cannot mount: {reason}", file=sys.stderr)
        return 2
    host = build_scenario(args.scenario, args.seed)
    # Signal handlers before mounting: a SIGTERM at any moment ends in a clean unmount.
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    ops, kpipe = {}, None
    if args.kmsg:
        from .kmsg_pipe import KmsgPipe, kmsg_op

        kpipe = KmsgPipe(host.kernel_log, args.kmsg).start()
        ops["kmsg"] = kmsg_op(host.kernel_log)
    runner = SimRunner(host, interval=args.step_interval, control_socket=args.control, control_ops=ops)
    runner.start()
    try:
        with mount(host, args.mountpoint):
            print(f"gpuguard.sim.fuse: serving {args.scenario} at {args.mountpoint}", flush=True)
            while not done.wait(0.2):
                if not os.path.ismount(args.mountpoint):
                    break            # unmounted from outside (fusermount3 -u)
    except RuntimeError as e:
        print(f"gpuguard.sim.fuse: {e}", file=sys.stderr)
        return 1
    finally:
        runner.stop()
        if kpipe is not None:
            kpipe.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
