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

from .host import SimHost

FUSERMOUNT = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"


class SimFS(mfusepy.Operations if mfusepy is not None else object):  # type: ignore[misc]
    use_ns = True

    def __init__(self, host: SimHost) -> None:
        self.host = host
        self.fh = itertools.count(1)
        self.open_files: dict[int, tuple[str, bytes | None]] = {}
        self._lock = threading.Lock()
        self.mounted_at = int(time.time() * 1e9)

    def _uid(self) -> int:
        try:
            return mfusepy.fuse_get_context()[0]
        except Exception:  # noqa: BLE001 - no context outside a request
            return 0

    @staticmethod
    def _err(e: OSError) -> OSError:
        return mfusepy.FuseOSError(e.errno or errno.EIO)

    def getattr(self, path, fh=None):
        try:
            st = self.host.getattr(path)
        except OSError as e:
            raise self._err(e) from None
        kind = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "link": stat.S_IFLNK}[st.kind]
        t = self.mounted_at
        return {"st_mode": kind | st.mode, "st_nlink": 2 if st.kind == "dir" else 1, "st_size": st.size,
                "st_uid": 0, "st_gid": 0, "st_atime": t, "st_mtime": t, "st_ctime": t}

    def readdir(self, path, fh):
        try:
            return [".", ".."] + self.host.readdir(path)
        except OSError as e:
            raise self._err(e) from None

    def readlink(self, path):
        try:
            return self.host.readlink(path)
        except OSError as e:
            raise self._err(e) from None

    def open(self, path, flags):
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
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
        try:
            return self.host.write(path, bytes(data), uid=self._uid())
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise mfusepy.FuseOSError(errno.ENODEV) from None
            raise self._err(e) from None

    def truncate(self, path, length, fh=None):
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


def unmount(mountpoint: str) -> None:
    subprocess.run([FUSERMOUNT, "-u", mountpoint], check=False, capture_output=True)
    if os.path.ismount(mountpoint):
        subprocess.run([FUSERMOUNT, "-uz", mountpoint], check=False, capture_output=True)


@contextlib.contextmanager
def mount(host: SimHost, mountpoint: str, timeout: float = 10.0):
    """Mount `host` at `mountpoint` in a background thread; unmount cleanly on exit."""
    reason = fuse_available()
    if reason:
        raise RuntimeError(f"cannot mount the simulated host: {reason}")
    os.makedirs(mountpoint, exist_ok=True)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            mfusepy.FUSE(SimFS(host), mountpoint, **_options())
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)

    t = threading.Thread(target=serve, name=f"simfuse:{mountpoint}", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    try:
        while not os.path.ismount(mountpoint):
            if errors or not t.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"FUSE mount of {mountpoint} failed: {errors[0] if errors else 'timeout'}")
            time.sleep(0.01)
    except BaseException:  # a failed mount, or Ctrl-C while mounting: leave no mount behind
        unmount(mountpoint)
        raise
    try:
        yield mountpoint
    finally:
        host.release_all()
        unmount(mountpoint)
        t.join(timeout)


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
