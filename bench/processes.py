"""What the side-by-side benchmarks share: a free port, waiting for a process to answer
HTTP, its memory from /proc, and the environment a daemon runs in as installed."""
from __future__ import annotations

import compileall
import os
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM (its peak) and the RSS's parts (RssAnon: the heap; RssFile: mapped
    files, libraries; RssShmem: shared memory such as SQLite's WAL index) in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return out


def wait_up(url: str, proc: subprocess.Popen, what: str = "", timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what or proc.args} exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what or proc.args} did not answer {url} within {timeout:.0f} s")


def installed_env(daemon_dir: str) -> dict[str, str]:
    """The environment for a gpuguard process run as installed: its package on the path
    and its bytecode compiled, as pip leaves an installation (these machines set
    PYTHONDONTWRITEBYTECODE, so without this every start compiles 27 000 lines and
    carries the compiler's garbage: 1-2 MiB of RSS that no installed daemon has)."""
    compileall.compile_dir(os.path.join(daemon_dir, "gpuguard"), quiet=1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (daemon_dir, os.environ.get("PYTHONPATH")) if p))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("NOTIFY_SOCKET", None)
    return env
