"""Talking to systemd over sd_notify (the sdnotify package): READY=1 once discovery and
the on-ready work (profile apply + read-back) are done, WATCHDOG=1 from the poll loop
only, STATUS= one summary line, RELOADING=1 / READY=1 around a reload, STOPPING=1.

Outside systemd (no NOTIFY_SOCKET) every call is a no-op. WATCHDOG=1 is only ever sent by
the caller's poll cycle, never from a timer thread: a thread would keep pinging while the
event loop is wedged, and the point of `WatchdogSec=` is that systemd restarts a daemon
whose loop no longer runs.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("gpuguard.systemd")


class SystemdNotify:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = None
        if self.enabled:
            import sdnotify

            self._n = sdnotify.SystemdNotifier()
            if self._n.socket is not None:
                # a full notify queue must drop a ping, not block the event loop
                self._n.socket.setblocking(False)

    def send(self, text: str) -> None:
        if self._n is not None:
            self._n.notify(text)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={_one_line(status)}")

    def watchdog(self, status: str) -> None:
        self.send(f"WATCHDOG=1\nSTATUS={_one_line(status)}")

    def reloading(self) -> None:
        self.send("RELOADING=1")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    @staticmethod
    def watchdog_seconds() -> float | None:
        """systemd's WatchdogSec= for this process (WATCHDOG_USEC), None when off."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 1e6
        except ValueError:
            return None

    def check_interval(self, cycle_seconds: float) -> None:
        """Warn when the poll cycle is too slow for WatchdogSec= (systemd would kill a
        healthy daemon)."""
        wd = self.watchdog_seconds()
        if wd is not None and cycle_seconds * 2 > wd:
            log.warning(
                "watchdog WatchdogSec=%gs is less than twice the poll cycle (%gs); raise WatchdogSec= "
                "or lower poll.interval_seconds + poll.timeout_seconds",
                wd,
                cycle_seconds,
            )


def _one_line(s: str) -> str:
    return s.replace("\n", " ").strip()
