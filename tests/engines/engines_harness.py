"""Helpers for the engine watchdog tests (imported by conftest and the tests): real
simulated-engine processes on loopback ports, a control client, and a way to run the real
watchdog loop until a condition holds."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from support import STARTS

REPO = Path(__file__).resolve().parents[2]
DAEMON = REPO / "daemon"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sim_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(DAEMON) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def wait_for(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class SimEngine:
    """One `python -m gpuguard.sim.engines` process (its own session, like a unit)."""

    def __init__(self, kind: str, *args: str, wait_ready: bool = True, supervise: bool = False) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gpuguard.sim.engines", "--kind", kind, "--port", str(self.port), *args]
        if supervise:
            cmd = [sys.executable, "-m", "gpuguard.sim.engines_restart", "--restart-sec", "0.2", "--", *cmd]
        self.proc = subprocess.Popen(cmd, env=sim_env(), start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid
        if wait_ready:
            wait_for(self.answers, STARTS, what=f"sim {kind} on :{self.port}")

    def answers(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def control(self, cmd: str, **body) -> dict:
        r = httpx.post(f"{self.url}/sim/{cmd}", json=body, timeout=2)
        r.raise_for_status()
        return r.json()

    def tree(self) -> list[int]:
        try:
            p = psutil.Process(self.pid)
            return [self.pid] + [c.pid for c in p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        # The engine under the Restart= stand-in runs in its own session: kill every group
        # in the tree, not just the top one, or the engine outlives the test.
        groups = [self.pid]  # the supervisor's first: it stops respawning
        try:
            for child in psutil.Process(self.pid).children(recursive=True):
                try:
                    if (g := os.getpgid(child.pid)) not in groups:
                        groups.append(g)
                except ProcessLookupError:
                    pass
        except psutil.NoSuchProcess:
            pass
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=5)
        except (subprocess.TimeoutExpired, ChildProcessError):
            pass


def stopped(pid: int) -> bool:
    """Every thread of `pid` in the stopped state ('T'). `kill(SIGSTOP)` returns once the
    signal is queued: a thread that is not yet scheduled (a loaded machine) still runs,
    and one woken by something else meanwhile (its pipe closing) can act, or exit, first."""
    from gpuguard.engines.process import read_proc_stat

    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    # a thread's /proc/TID is not listed but readable: its stat holds that thread's state
    return bool(tids) and all((st := read_proc_stat(t)) is not None and st.state == "T" for t in tids)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def run_watchdog_until(wd, pred, timeout: float, interval: float = 0.02):
    """Run the real `EngineWatchdog.run()` loop until pred() is truthy; returns its value."""
    task = asyncio.create_task(wd.run())
    try:
        deadline = time.monotonic() + timeout
        while True:
            value = pred()
            if value:
                return value
            if task.done():
                task.result()
                raise AssertionError("watchdog loop ended")
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(interval)
    finally:
        task.cancel()
        # the watchdog's own shutdown is bounded; bound the test's wait for it too
        await asyncio.wait({task}, timeout=15)
        if not task.done():
            import io
            out = io.StringIO()
            for t in asyncio.all_tasks():
                t.print_stack(file=out)
            raise AssertionError("the watchdog loop did not stop within 15 s of being cancelled:\n" + out.getvalue())


def engine_cfg(name: str, kind: str, url: str, **kw):
    from gpuguard.engines.config import EngineConfig
    process = kw.pop("process", None)
    data = {"name": name, "kind": kind, "url": url, "process": process, **kw}
    return EngineConfig.model_validate(data)


# A process whose main thread has ended while another thread runs on: /proc shows its
# leader as a zombie ("Z"), psutil says STATUS_ZOMBIE, yet it lives, holds its GPU memory
# and stays in its cgroup. A SIGKILL'd multi-threaded engine passes through the same state
# while its threads are torn down (CI caught a kill that said "gone" in that window).
ZOMBIE_LEADER = ("import ctypes, signal, threading, time\n"
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "threading.Thread(target=lambda: [time.sleep(0.05) for _ in iter(int, 1)]).start()\n"
                 "print('ready', flush=True)\n"
                 "ctypes.CDLL(None).pthread_exit(None)\n")
