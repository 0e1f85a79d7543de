"""Finding an engine's processes, every cycle (a PID is never cached across cycles: after a
restart the old one is gone or reused), and reading their CPU time and state from /proc.
The engine is its main process and that process's descendants, or every process of its
cgroup (a systemd unit's, or a configured one): never a process group or session, which
may hold bystanders. Blocking; the watchdog calls `resolve` in a worker thread."""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpuguard.engines.config import EngineConfig

CLK_TCK = os.sysconf("SC_CLK_TCK")


class ProcessLookupFailed(RuntimeError):
    """The configured way of finding the engine failed in a way worth saying (not just 'down')."""


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str  # R S D T Z ...
    cpu_seconds: float
    start_time: float  # epoch seconds
    pgid: int


@dataclass(frozen=True)
class EngineProcesses:
    main_pid: int
    main_start: float
    gpu_pid: int
    gpu_stat: ProcStat
    pids: tuple[int, ...]  # main + descendants (+ the cgroup's members), as seen now
    pgid: int
    note: str = ""
    cgroup: Path | None = None  # the cgroup folder the kill goes through, when known
    batch_tokens: int | None = None  # largest prompt batch of one step (command line or config)


def _boot_time(proc: Path) -> float:
    for line in (proc / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise ProcessLookupFailed(f"{proc}/stat has no btime line")


def read_proc_stat(pid: int, proc: Path = Path("/proc")) -> ProcStat | None:
    """utime+stime, state, start time and pgid from /proc/PID/stat; None if gone."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may hold spaces and ')': fields start after the LAST ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        state = rest[0]
        pgid = int(rest[2])
        utime, stime = int(rest[11]), int(rest[12])
        start_ticks = int(rest[19])
    except (IndexError, ValueError) as exc:
        raise ProcessLookupFailed(f"{proc}/{pid}/stat: unexpected content ({exc}): {raw[:120]!r}") from None
    return ProcStat(pid, state, (utime + stime) / CLK_TCK, _boot_time(proc) + start_ticks / CLK_TCK, pgid)


def _systemd_main_pid(unit: str, timeout: float = 2.0) -> int | None:
    try:
        out = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit],
                             capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ProcessLookupFailed(f"unit {unit}: systemctl not found; use process.pid_file or cmdline") from None
    except subprocess.TimeoutExpired:
        raise ProcessLookupFailed(f"unit {unit}: systemctl show timed out after {timeout:g} s") from None
    if out.returncode != 0:
        raise ProcessLookupFailed(f"unit {unit}: systemctl show failed: {out.stderr.strip() or out.returncode}")
    text = out.stdout.strip()
    if not text.isdigit():
        raise ProcessLookupFailed(f"unit {unit}: MainPID {text!r} is not a number")
    pid = int(text)
    return pid or None


def _pid_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProcessLookupFailed(f"pid file {path}: {exc.strerror}") from None
    if not text.isdigit():
        raise ProcessLookupFailed(f"pid file {path}: {text[:40]!r} is not a PID; fix or remove it")
    pid = int(text)
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    # A PID reused after the engine died started after its pid file was written: stale.
    if started > path.stat().st_mtime + 2.0:
        return None
    return pid


def _cmdline_text(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return ""


SHELLS = {"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"}


def _is_shell_script(argv: list[str]) -> bool:
    """`sh -c "... engine ... &"`: the launcher's command line names the engine, but the
    shell is not the engine; killing it would take its other jobs."""
    return bool(argv) and os.path.basename(argv[0]) in SHELLS and "-c" in argv[1:3]


def _by_cmdline(pattern: str) -> int | None:
    rx = re.compile(pattern)
    me = os.getpid()
    matches: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info.get("cmdline") or []
        cmd = " ".join(argv)
        if p.pid != me and cmd and rx.search(cmd) and not _is_shell_script(argv):
            matches[p.pid] = p
    if not matches:
        return None
    # The root of the matching tree: a match whose parent is not itself a match.
    roots = []
    for pid, p in matches.items():
        try:
            if p.ppid() not in matches:
                roots.append(p)
        except psutil.Error:
            continue
    pick = min(roots or matches.values(), key=lambda p: (p.create_time() if p.is_running() else 0, p.pid))
    return pick.pid


def cgroup_procs(folder: Path) -> list[int] | None:
    """PIDs in a cgroup folder (v1 or v2 `cgroup.procs`); None when the folder is gone."""
    try:
        text = (Path(folder) / "cgroup.procs").read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProcessLookupFailed(f"cgroup {folder}: cannot read cgroup.procs: {exc.strerror}") from None
    return [int(x) for x in text.split() if x.isdigit()]


def _systemd_cgroup(unit: str, timeout: float = 2.0) -> Path | None:
    """The unit's cgroup folder under /sys/fs/cgroup (unified, or the hybrid layout's v2 or
    name=systemd tree), or None when systemd does not say."""
    try:
        out = subprocess.run(["systemctl", "show", "-p", "ControlGroup", "--value", unit],
                             capture_output=True, text=True, timeout=timeout, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    rel = out.stdout.strip().lstrip("/")
    if out.returncode != 0 or not rel:
        return None
    for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"):
        folder = Path(base) / rel
        if (folder / "cgroup.procs").exists():
            return folder
    return None


def _cgroup_main(folder: Path) -> int | None:
    members = cgroup_procs(folder)
    if not members:
        return None
    procs = []
    for pid in members:
        try:
            p = psutil.Process(pid)
            procs.append((p.ppid() in members, p.create_time(), pid))
        except psutil.Error:
            continue
    # The root of the tree inside the cgroup (its parent is outside), the oldest first.
    return min(procs)[2] if procs else None


def find_main_pid(cfg: EngineConfig) -> int | None:
    m = cfg.process
    if m.systemd_unit:
        return _systemd_main_pid(m.systemd_unit)
    if m.cgroup:
        return _cgroup_main(m.cgroup)
    if m.pid_file:
        return _pid_file(m.pid_file)
    return _by_cmdline(m.cmdline or "")


# The option that bounds one step's prompt batch, per kind, and its default (llama.cpp
# common.h n_batch = 2048; one llama_decode per n_batch chunk, server-context.cpp).
BATCH_FLAGS = {"llamacpp": (("-b", "--batch-size"), 2048),
               "vllm": (("--max-num-batched-tokens",), 8192),
               "sglang": (("--chunked-prefill-size",), 8192),
               "generic": ((), None)}


def batch_tokens(kind: str, argv: list[str], configured: int | None = None) -> int | None:
    if configured:
        return configured
    flags, default = BATCH_FLAGS.get(kind, ((), None))
    for i, arg in enumerate(argv):
        for flag in flags:
            value = None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            if value is not None and value.strip().isdigit() and int(value) > 0:
                return int(value)
    return default


def resolve(cfg: EngineConfig, proc: Path = Path("/proc")) -> EngineProcesses | None:
    """The engine's processes now, or None when it is not running."""
    pid = find_main_pid(cfg)
    if pid is None:
        return None
    main = read_proc_stat(pid, proc)
    if main is None or main.state == "Z":
        return None
    try:
        main_proc = psutil.Process(pid)
        kids = main_proc.children(recursive=True)
        argv = main_proc.cmdline()
    except psutil.Error:
        kids, argv = [], []
    pids = (pid,) + tuple(k.pid for k in kids)
    m = cfg.process
    folder = m.cgroup if m.cgroup else (_systemd_cgroup(m.systemd_unit) if m.systemd_unit else None)
    if folder is not None:
        members = cgroup_procs(folder) or []
        pids = pids + tuple(p for p in members if p not in pids)
    gpu_pid, note = pid, ""
    pattern = cfg.gpu_process_pattern
    if pattern and kids:
        rx = re.compile(pattern)
        for k in kids:
            try:
                label = f"{k.name()} {_cmdline_text(k)}"
            except psutil.Error:
                continue
            if rx.search(label):
                gpu_pid = k.pid
                break
        else:
            note = f"no child matches gpu_process {pattern!r}; using the main process"
    gpu_stat = read_proc_stat(gpu_pid, proc) or main
    return EngineProcesses(pid, main.start_time, gpu_stat.pid, gpu_stat, pids, main.pgid, note,
                           Path(folder) if folder is not None else None,
                           batch_tokens(cfg.kind, argv, cfg.prefill_batch_tokens))
