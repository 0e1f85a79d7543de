"""Helpers for the deployment tests: a real gpuguard daemon process on a simulated host
(plain tree), started the way the unit starts it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from support import poll_until

REPO = Path(__file__).resolve().parents[2]


class DaemonProcess:
    """`python -m gpuguard run` on a simulated host, its stderr kept in `lines`."""

    def __init__(self, root: Path, config: Path, env: dict | None = None) -> None:
        self.config = config
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard", "run", "--config", str(config), "--sysfs-root", str(root)],
            env=dict(os.environ, PYTHONPATH=str(REPO / "daemon"), **(env or {})),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(l) for l in self.proc.stderr], daemon=True).start()
        line = poll_until(lambda: [l for l in self.lines if "metrics at http://" in l] or self.proc.poll() is not None,
                          timeout=60, what="the daemon's ready line")
        if self.proc.poll() is not None:
            raise AssertionError("daemon exited at start:\n" + "".join(self.lines))
        self.base = line[0].split("metrics at ")[1].split("/metrics")[0]
        self.pid = self.proc.pid

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base + path, timeout=10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
