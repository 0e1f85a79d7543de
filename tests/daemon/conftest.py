"""A simulated host served by FUSE in its own process, and the daemon as a real process
reading it: real file I/O with kernel-like errno results end to end."""
from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.sim.control import send
from support import poll_until as wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimProcess:
    def __init__(self, tmp: Path, scenario: str = "incident", kmsg: bool = False) -> None:
        try:
            from gpuguard.sim.fuse import fuse_available
        except (ImportError, OSError) as e:  # no mfusepy, or no libfuse (FUSE_LIBRARY_NAME=none)
            pytest.skip(f"FUSE not usable here ({e}); CI runs this as root with fuse3 installed")
        reason = fuse_available()
        if reason:
            pytest.skip(f"FUSE not usable here ({reason}); CI runs this as root with fuse3 installed")
        self.mount = tmp / "root"
        self.sock = str(tmp / "sim.sock")
        # kmsg: the simulated kernel log as kernel records through a FIFO (sim/kmsg_pipe.py),
        # the daemon's kernel.kmsg_path: never the machine's own /dev/kmsg
        self.kmsg = tmp / "kmsg.fifo" if kmsg else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard.sim.fuse", str(self.mount), "--scenario", scenario,
             "--step-interval", "0", "--control", self.sock, *(["--kmsg", str(self.kmsg)] if kmsg else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        wait_for(lambda: (self.mount / "sys/bus/pci/devices").is_dir() and os.path.exists(self.sock)
                 and (self.kmsg is None or self.kmsg.exists()), what="the FUSE sim to mount")

    def ctl(self, op: str, **args):
        return send(self.sock, op, **args)

    def hwmon(self, bdf: str, name: str) -> str:
        (path,) = glob.glob(str(self.mount / f"sys/bus/pci/devices/{bdf}/hwmon/hwmon*/{name}"))
        return Path(path).read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)


class DaemonProcess:
    def __init__(self, tmp: Path, sysfs_root: Path, config_text: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "gpuguard.yaml"
        cfg.write_text(config_text + f"\nlisten: {{address: 127.0.0.1, port: {self.port}}}\nstate_dir: {tmp / 'state'}\n"
                       f"recorder: {{path: {tmp / 'state' / 'flight.sqlite'}}}\n")
        self.config = cfg
        self.log = tmp / "daemon.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard", "run", "--config", str(cfg), "--sysfs-root", str(sysfs_root)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
        wait_for(self.healthy, timeout=20, what=f"the daemon on {self.base} (log: {self.log})")

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log.read_text()}")
        return httpx.get(f"{self.base}/healthz", timeout=1).json()["ok"]

    def metrics(self) -> dict:
        text = httpx.get(f"{self.base}/metrics", timeout=2).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def value(self, name: str, **labels) -> float | None:
        return self.metrics().get((name, tuple(sorted(labels.items()))))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def sim(tmp_path):
    s = SimProcess(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def sim_kmsg(tmp_path):
    """The incident host whose kernel log reaches the daemon (kernel.kmsg_path: sim.kmsg)."""
    s = SimProcess(tmp_path, kmsg=True)
    yield s
    s.stop()


@pytest.fixture
def sim_spare_slot(tmp_path):
    """The incident host with an empty hotplug slot (root port 0000:00:03.2)."""
    s = SimProcess(tmp_path, "incident-spare-slot")
    yield s
    s.stop()


@pytest.fixture
def start_daemon(tmp_path):
    procs = []

    def start(sysfs_root: Path, config_text: str = "", **kw) -> DaemonProcess:
        d = DaemonProcess(tmp_path, sysfs_root, config_text, **kw)
        procs.append(d)
        return d

    yield start
    for d in procs:
        d.stop()
