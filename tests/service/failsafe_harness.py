"""The daemon as a real process on the simulated incident host (plain tree), for the
fail-safe tests (issue 12): tiny tmpfs mounts for a full or read-only state folder, a
stderr log the test can search, the served base URL."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree

REPO = Path(__file__).resolve().parents[2]
XTX = "0000:aa:00.0"


def can_mount() -> str | None:
    """None when tmpfs mounts work here, else why not (the tests skip with it)."""
    if os.geteuid() != 0:
        return "needs root: mounts a tiny tmpfs for the state folder"
    return None


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "256k", readonly: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0750" + (",ro" if readonly else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Fill the filesystem at `path` to the last byte."""
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass


def sim_root(tmp: Path) -> Path:
    root = tmp / "root"
    if not root.exists():
        write_tree(build_scenario("incident"), str(root))
    return root


def od_file(root: Path, bdf: str = XTX) -> Path:
    return next(root.glob(f"sys/devices/**/{bdf}/pp_od_clk_voltage"))


def config_text(state: Path, tmp: Path, token_file: Path | None, webhook: str | None = None, extra: str = "") -> str:
    return (
        f"state_dir: {state}\nrecorder: {{path: {tmp}/flight.sqlite}}\n"
        "listen: {address: 127.0.0.1, port: 0}\npoll: {interval_seconds: 0.3}\n"
        + (f"api: {{token_file: {token_file}}}\n" if token_file else "")
        + (f"webhooks:\n  - url: {webhook}\n" if webhook else "")
        + f"gpus:\n  - name: xtx-0\n    match: {{bdf: '{XTX}'}}\n"
        + "profiles:\n  quiet: {power_cap_w: 250}\n"
        + extra
    )


class GuardProcess:
    def __init__(self, cfg: Path, root: Path, env: dict | None = None) -> None:
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard", "run", "--config", str(cfg), "--sysfs-root", str(root)],
            env=dict(os.environ, PYTHONPATH=str(REPO / "daemon"), **(env or {})),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self._drained = threading.Thread(target=self._drain, daemon=True)
        self._drained.start()
        self.base: str | None = None

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def log_has(self, pattern: str) -> list[str]:
        return [l for l in list(self.lines) if re.search(pattern, l)]

    def output(self) -> str:
        self._drained.join(10)
        return "\n".join(self.lines)

    def find_base(self, wait, timeout: float = 30) -> str:
        line = wait(lambda: self.log_has(r"metrics at http://") or self.proc.poll() is not None, timeout=timeout,
                    what="the ready log line")
        if line is True:
            raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
        line = line[0]
        self.base = re.search(r"(http://[0-9.]+:[0-9]+)/metrics", line).group(1)
        return self.base

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode
