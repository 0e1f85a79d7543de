"""The state folder (`state_dir`): who owns it and whether it can be written.

One daemon per state folder: the daemon holds an exclusive `flock` on the folder itself
for its whole life (a lock on the directory's own descriptor works on a read-only mount
too, and dies with the process, SIGKILL included). A second daemon on the same folder
refuses to start and names the holder's PID (two daemons both applied
profiles and the recorder got every row twice).

Usable or not: the audit log, the safe-mode marker, the kmsg position and the recorder
live there. A folder that is missing and cannot be made, read-only, or full must never
crash the daemon: it starts, serves telemetry, and refuses only what needs the folder
(applies and other audited actions). `health` says which, for /healthz, STATUS= and an
alert; it is re-probed while bad and flips back when writes succeed again.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("gpuguard.state_dir")

PID_FILE = "gpuguard.pid"
PROBE_FILE = ".gpuguard-probe"


class StateDirLocked(RuntimeError):
    """Another live process holds the state folder."""


@dataclass(frozen=True)
class StateHealth:
    usable: bool
    reason: str  # "" when usable

    def to_dict(self) -> dict:
        return {"usable": self.usable, "reason": self.reason or None}


def _holder_from_proc_locks(path: str) -> int | None:
    """The PID holding a flock on `path`'s inode, from /proc/locks (when no pid file)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


class StateDir:
    def __init__(self, path: str, probe_every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.probe_every = probe_every
        self.clock = clock
        self._fd: int | None = None
        self._health = StateHealth(True, "")
        self._last_probe = -1e9
        self._lock = threading.Lock()
        self.on_change: list[Callable[[StateHealth], None]] = []

    # -- ownership ----------------------------------------------------------------------
    def acquire(self) -> None:
        """Lock the folder (made if missing). Raises StateDirLocked when another process
        holds it. A folder that cannot be made or opened is not an error here: the daemon
        runs without state (see `health`)."""
        try:
            os.makedirs(self.path, mode=0o750, exist_ok=True)
        except OSError as e:
            self._set(StateHealth(False, f"state_dir {self.path} cannot be made: {e.strerror}"))
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            self._set(StateHealth(False, f"state_dir {self.path} cannot be opened: {e.strerror}"))
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                self._set(StateHealth(False, f"state_dir {self.path} cannot be locked: {e.strerror}"))
                return
            pid = self._pid_from_file() or _holder_from_proc_locks(self.path)
            who = f"PID {pid}" if pid else "another process"
            raise StateDirLocked(
                f"state_dir {self.path} is in use by {who} (another gpuguard daemon); "
                "one daemon per state folder: stop it, or give this one its own state_dir"
            ) from None
        self._fd = fd
        self._write_pid()
        self.probe(force=True)

    def _pid_from_file(self) -> int | None:
        try:
            with open(os.path.join(self.path, PID_FILE)) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return None
        return pid if pid > 0 and os.path.exists(f"/proc/{pid}") else None

    def _write_pid(self) -> None:
        p = os.path.join(self.path, PID_FILE)
        try:
            with open(p + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(p + ".tmp", p)
        except OSError:
            pass  # read-only or full: the probe says so; the holder is still found by /proc/locks

    def release(self) -> None:
        if self._fd is not None:
            try:
                if self._pid_from_file() == os.getpid():
                    os.unlink(os.path.join(self.path, PID_FILE))
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None

    @property
    def locked(self) -> bool:
        return self._fd is not None

    # -- health -------------------------------------------------------------------------
    @property
    def health(self) -> StateHealth:
        return self._health

    def _set(self, h: StateHealth) -> None:
        with self._lock:
            changed = h.usable != self._health.usable  # transitions alert; a new reason only updates
            self._health = h
        if changed:
            if h.usable:
                log.warning("state_dir %s is writable again", self.path)
            else:
                log.error("%s; applies and other audited actions are refused until it is fixed", h.reason)
            for fn in list(self.on_change):
                try:
                    fn(h)
                except Exception as e:  # noqa: BLE001 - a listener must not break the writer
                    log.error("state_dir listener failed: %s", e)

    def failed(self, path: str, err: OSError) -> None:
        """A write below the folder failed (the audit log, a marker)."""
        self._set(StateHealth(False, f"state_dir {self.path} not writable: {path}: {err.strerror or err}"))

    def succeeded(self) -> None:
        if not self._health.usable:
            self._set(StateHealth(True, ""))

    def probe(self, force: bool = False) -> StateHealth:
        """Write, fsync and remove a small file. Rate-limited unless `force`."""
        now = self.clock()
        if not force and now - self._last_probe < self.probe_every:
            return self._health
        self._last_probe = now
        p = os.path.join(self.path, PROBE_FILE)
        try:
            os.makedirs(self.path, mode=0o750, exist_ok=True)
        except OSError as e:
            self._set(StateHealth(False, f"state_dir {self.path} cannot be made: {e.strerror}"))
            return self._health
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"x" * 512)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(p)
        except OSError as e:
            try:
                os.unlink(p)
            except OSError:
                pass
            self.failed(p, e)
        else:
            self.succeeded()
        return self._health


def report_to(state: StateDir, hub) -> None:
    """Say the folder's health where an operator looks: a STATUS=/summary note, and an
    alert event (webhook) each time it turns unusable."""
    from gpuguard.state.events import Event

    def on_change(h: StateHealth) -> None:
        hub.notes["state_dir"] = "" if h.usable else "STATE DIR UNUSABLE: applies refused"
        if not h.usable:
            hub.publish(Event("state_dir_unusable", "alert", "state", h.reason + "; telemetry continues, applies and "
                              "other audited actions are refused", fields={"state_dir": state.path}))
        else:
            hub.publish(Event("state_dir_usable", "info", "state", f"state_dir {state.path} is writable again"))

    state.on_change.append(on_change)
    if not state.health.usable:
        on_change(state.health)
