"""Safe mode: a bad profile must never lock a user out. If the host went down within
`window` seconds of applying profiles on `threshold` starts in a row (a crash or a power
trip after apply — INCIDENTS §2's PSU trip came 47 s into load), the next start applies
nothing and alerts why. The kernel command-line word `gpuguard.safe` forces it.

State lives in `<state_dir>/profiles-safemode.json`: the last apply's wall time, the
boot id it happened in, whether the process stopped cleanly, whether the host outlived
the window, and the streak of crashes after apply. A new boot id with neither a clean
stop nor "survived" is a host that went down. Safe mode is sticky: it ends when a
person applies by hand (`gpuguard apply`) or removes the file.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpuguard.hw.sysfs import SysfsError, SysfsRoot

log = logging.getLogger("gpuguard.profiles")

STATE_FILE = "profiles-safemode.json"
CMDLINE_WORD = "gpuguard.safe"


@dataclass(frozen=True)
class SafeDecision:
    safe: bool
    reason: str


class SafeModeGuard:
    def __init__(self, state_dir: str, root: SysfsRoot, window: float = 300.0, threshold: int = 2,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = os.path.join(state_dir, STATE_FILE)
        self.root = root
        self.window = window
        self.threshold = threshold
        self.clock = clock
        self.state: dict[str, Any] = {}

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {"corrupt": True}

    def _save(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.state, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # the state must survive the very crash it records
        except OSError as e:
            # a read-only or full state_dir crashed the start here. The marker is
            # lost; applies are refused anyway while the audit log cannot be written.
            log.error("safe-mode marker not saved path=%s error=%s", self.path, e.strerror or e)

    def boot_id(self) -> str | None:
        try:
            return self.root.read_text("proc/sys/kernel/random/boot_id") or None
        except SysfsError:
            return None

    def cmdline_forces(self) -> bool:
        try:
            return CMDLINE_WORD in self.root.read_text("proc/cmdline").split()
        except SysfsError:
            return False

    def decide(self) -> SafeDecision:
        """Called once at start, before any apply. Updates the crash streak."""
        prev = self._load()
        boot = self.boot_id()
        crashed = bool(
            prev.get("applied_at")
            and not prev.get("clean_stop")
            and not prev.get("survived")
            and (boot is None or prev.get("boot_id") != boot)
        )
        streak = int(prev.get("streak", 0)) + 1 if crashed else (0 if prev.get("applied_at") else int(prev.get("streak", 0)))
        sticky = prev.get("safe_reason")
        self.state = {"streak": streak, "boot_id": boot, "started_at": self.clock()}
        if self.cmdline_forces():
            return SafeDecision(True, f"kernel command line has '{CMDLINE_WORD}': profiles are not applied")
        if sticky:
            self.state["safe_reason"] = sticky
            self._save()
            return SafeDecision(True, f"{sticky} (still in safe mode: run `gpuguard apply` by hand to apply and "
                                      f"leave it, or remove {self.path})")
        if streak >= self.threshold:
            reason = (f"safe mode: the host went down within {self.window:.0f} s of applying profiles on "
                      f"{streak} starts in a row; profiles are not applied")
            self.state["safe_reason"] = reason
            self._save()
            return SafeDecision(True, reason + f" (run `gpuguard apply` by hand to apply and leave safe mode, or remove {self.path})")
        self._save()
        return SafeDecision(False, "")

    def record_apply(self) -> None:
        """Profiles were just written: the crash window starts now."""
        if not self.state:
            self.state = {"streak": int(self._load().get("streak", 0)), "boot_id": self.boot_id()}
        self.state.update({"applied_at": self.clock(), "clean_stop": False, "survived": False})
        self.state.pop("safe_reason", None)
        self._save()

    def heartbeat(self) -> None:
        """Call periodically: once the host has outlived the window, the apply was not the crash."""
        at = self.state.get("applied_at")
        if at and not self.state.get("survived") and self.clock() - at >= self.window:
            self.state.update({"survived": True, "streak": 0})
            self._save()

    def record_clean_stop(self) -> None:
        if self.state:
            self.state["clean_stop"] = True
            self._save()

    def clear(self) -> None:
        """A person applied by hand: leave safe mode and forget the streak."""
        self.state = {"streak": 0, "boot_id": self.boot_id()}
        self._save()
