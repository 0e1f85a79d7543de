"""Finding an engine's processes, every cycle (a PID is never cached across cycles: after a
restart the old one is gone or reused), and reading their CPU time and state from /proc.
The engine is its main process and that process's descendants, or every process of its
cgroup (a systemd unit's, or a configured one): never a process group or session, which
may hold bystanders. What is found must be the engine the config names: a pid file only
root or the engine's user could have written, a process of that user, the unit's own
cgroup, a `cmdline` regex narrower than "any process"; and never PID 1, gpuguard itself,
its parents or a kernel thread (a root gpuguard aimed elsewhere by a pid file killed an
unrelated tree). Blocking; the watchdog calls `resolve` in a worker thread."""
from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpuguard.engines.config import EngineConfig, matches_any_process

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


REFUSED = "refused, nothing signalled"
PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread (include/linux/sched.h)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _kernel_thread(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return bool(int(raw[raw.rfind(")") + 2:].split()[6]) & PF_KTHREAD)
    except (OSError, IndexError, ValueError):
        return False


class Protected:
    """The processes no engine kill may touch, as they are now: PID 1, gpuguard itself, its
    parents (a `cmdline` matched `timeout … python -m pytest …`, the shell that started
    the run) and kernel threads. `why(pid)` -> the reason, or None."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.parents: dict[int, str] = {}
        try:
            for p in psutil.Process(self.me).parents():
                self.parents[p.pid] = _name(p)
        except psutil.Error:
            pass

    def why(self, pid: int) -> str | None:
        if pid <= 0:  # kill(0) and kill(-1) are gpuguard's own group and every process
            return f"PID {pid} (not a process)"
        if pid == 1:
            return "PID 1 (init)"
        if pid == self.me:
            return f"PID {pid} (gpuguard itself)"
        if pid in self.parents:
            return f"PID {pid} (a parent of gpuguard: {self.parents[pid]})"
        if _kernel_thread(pid):
            return f"PID {pid} (a kernel thread)"
        return None


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def protected(pid: int) -> str | None:
    """Why `pid` is never an engine (PID 1, gpuguard, its parents, a kernel thread), or None."""
    return Protected().why(pid)


def engine_uid(cfg: EngineConfig) -> int | None:
    """The uid of `process.user`, or None when none is configured."""
    user = cfg.process.user
    if user is None:
        return None
    if isinstance(user, int) or str(user).isdigit():
        return int(user)
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ProcessLookupFailed(f"process.user {user!r}: no such user on this host; {REFUSED}") from None


def _trusted_pid_file(path: Path, st: os.stat_result, uid: int | None, what: str = "") -> None:
    """Only root or the engine's user may have written the file that aims the kill (or
    gpuguard's own user, when it runs as another: it can signal no one else's processes)."""
    me = os.geteuid()
    allowed = {0, me} | ({uid} if uid is not None else set())
    if st.st_uid not in allowed:
        mine = (f"the engine's user {_user_name(uid)} (uid {uid})" if uid is not None
                else "the engine's user (process.user)")
        ours = f", gpuguard's user {_user_name(me)}" if me else ""
        raise ProcessLookupFailed(f"pid file {path}{what} is owned by {_user_name(st.st_uid)} (uid {st.st_uid}), "
                                  f"not by root{ours} or {mine}: anyone else may have written it; {REFUSED}")
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable and not stat.S_ISLNK(st.st_mode):
        raise ProcessLookupFailed(f"pid file {path} is writable by {' and '.join(writable)} "
                                  f"(mode {stat.S_IMODE(st.st_mode):04o}): anyone else may have written it; "
                                  f"chmod go-w it; {REFUSED}")


def _pid_file(path: Path, uid: int | None = None) -> int | None:
    try:
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode):  # a link planted beside the file aims as well as the file
            _trusted_pid_file(path, link, uid, " (a symlink)")
        # non-blocking: a FIFO planted at this path must not wedge the lookup
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProcessLookupFailed(f"pid file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        _trusted_pid_file(path, st, uid)
        if not stat.S_ISREG(st.st_mode):
            raise ProcessLookupFailed(f"pid file {path}: " + ("Is a directory" if stat.S_ISDIR(st.st_mode)
                                                              else f"not a regular file; {REFUSED}"))
        text = os.read(fd, 4096).decode(errors="replace").strip()
    except OSError as exc:
        raise ProcessLookupFailed(f"pid file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if not text.isdigit():
        raise ProcessLookupFailed(f"pid file {path}: {text[:40]!r} is not a PID; fix or remove it")
    pid = int(text)
    if pid <= 1:  # before anything reads its tree: PID 1's is every process
        raise ProcessLookupFailed(f"pid file {path} names {Protected().why(pid)}, never an engine; {REFUSED}")
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    # A PID reused after the engine died started after its pid file was written: stale.
    if started > st.st_mtime + 2.0:
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


def _by_cmdline(pattern: str, uid: int | None = None) -> int | None:
    if what := matches_any_process(pattern):  # a config that skipped validation
        raise ProcessLookupFailed(f"cmdline {pattern!r} matches any process (it matches {what}); {REFUSED}")
    rx = re.compile(pattern)
    never = Protected()
    matches: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        argv = p.info.get("cmdline") or []
        cmd = " ".join(argv)
        if uid is not None and (p.info.get("uids") is None or p.info["uids"].real != uid):
            continue
        if cmd and rx.search(cmd) and not _is_shell_script(argv) and never.why(p.pid) is None:
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
        return _pid_file(m.pid_file, engine_uid(cfg))
    return _by_cmdline(m.cmdline or "", engine_uid(cfg))


def _found_by(cfg: EngineConfig, pid: int) -> str:
    m = cfg.process
    return (f"unit {m.systemd_unit}'s MainPID {pid}" if m.systemd_unit else
            f"cgroup {m.cgroup}'s main PID {pid}" if m.cgroup else
            f"pid file {m.pid_file} names PID {pid}" if m.pid_file else
            f"cmdline /{m.cmdline}/ matched PID {pid}")


def _in_cgroup(folder: Path, pid: int) -> bool:
    """Whether `pid` is in the cgroup at `folder` or one below it (a unit may delegate)."""
    for dirpath, _dirs, files in os.walk(folder):
        if "cgroup.procs" in files and pid in (cgroup_procs(Path(dirpath)) or ()):
            return True
    return False


def _check_identity(cfg: EngineConfig, pid: int, pids: tuple[int, ...], folder: Path | None) -> None:
    """The processes found are the engine the config names, or nothing is (raises)."""
    never = Protected()
    if why := never.why(pid):
        raise ProcessLookupFailed(f"{_found_by(cfg, pid)}: {why}, never an engine; {REFUSED}")
    uid = engine_uid(cfg)
    if uid is not None:
        try:
            real = psutil.Process(pid).uids().real
        except psutil.Error:
            real = None
        if real is not None and real != uid:
            raise ProcessLookupFailed(f"{_found_by(cfg, pid)}, which runs as {_user_name(real)} "
                                      f"(uid {real}), not as the engine's user {_user_name(uid)} (uid {uid}); {REFUSED}")
    if cfg.process.systemd_unit and folder is not None and not _in_cgroup(folder, pid):
        raise ProcessLookupFailed(f"unit {cfg.process.systemd_unit}: MainPID {pid} is not in the unit's cgroup "
                                  f"{folder}; {REFUSED}")
    for other in pids:  # a cgroup holding init or gpuguard is no engine's
        if other != pid and (why := never.why(other)):
            where = f"cgroup {folder}" if folder is not None else f"the process tree of PID {pid}"
            raise ProcessLookupFailed(f"{where} holds {why}: not an engine's; {REFUSED}")


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
    _check_identity(cfg, pid, pids, Path(folder) if folder is not None else None)
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
