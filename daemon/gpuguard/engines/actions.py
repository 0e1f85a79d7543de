"""What the watchdog does to an engine: kill (SIGTERM to exactly the engine's processes —
its process tree, and its cgroup's members when it has one — SIGKILL after the grace
period, verify every process is gone) and restart (`systemctl restart UNIT`, or kill and
run the configured command). Never a process group or a session: those may hold
bystanders. Never PID 1, gpuguard itself, its parents or a kernel thread, whatever the
PIDs given (engines/process.Protected, checked again at the signal: the tree and the
cgroup are read anew here). Async: waiting out a grace period never blocks the event loop."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpuguard.engines.process import Protected, cgroup_procs


@dataclass(frozen=True)
class KillResult:
    pids: tuple[int, ...]
    cgroup: str | None
    signals: tuple[str, ...]  # in order: "SIGTERM pid 123", "SIGKILL cgroup.kill /sys/...", ...
    escalated: bool  # SIGKILL was needed (ignored SIGTERM, or stopped: SIGTERM never arrives)
    gone: bool
    survivors: tuple[int, ...]
    seconds: float
    # what was found but never signalled, each with why ("PID 1 (init)", ...): the engine is
    # not "gone" while one of these was in it
    refused: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"pids": list(self.pids), "cgroup": self.cgroup, "signals": list(self.signals),
                "escalated": self.escalated, "gone": self.gone, "survivors": list(self.survivors),
                "seconds": round(self.seconds, 3), "refused": list(self.refused)}


def _alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE and not _threads_left(pid):
            _reap(pid)
            return False
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _threads_left(pid: int) -> bool:
    """Whether a process whose leader shows as a zombie still has a running thread: its
    main thread has ended but the process lives on (/proc shows the leader "Z"; psutil
    says zombie), holding its GPU memory and its place in the cgroup. A SIGKILL'd
    multi-threaded engine passes through that state while its threads are torn down."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            return True
    return False


def _reap(pid: int) -> None:
    """A zombie that is our own child (tests, `gpuguard demo`) is gone once reaped."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tree(pids: set[int]) -> set[int]:
    """The given PIDs and all their descendants, as they are now."""
    out = set(pids)
    for pid in pids:
        try:
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return out


def _members(pids: set[int], cgroup: Path | None) -> set[int]:
    found = _tree(pids)
    if cgroup is not None:
        try:
            found.update(cgroup_procs(cgroup) or ())
        except Exception:  # noqa: BLE001 - an unreadable cgroup leaves the tree
            pass
    return found


async def kill_engine(pids: tuple[int, ...], grace: float, *, cgroup: Path | None = None, poll: float = 0.02,
                      after_sigkill: float = 5.0) -> KillResult:
    """SIGTERM every process of the engine (tree + cgroup), wait up to `grace`, SIGKILL what
    is left (through `cgroup.kill` when the cgroup has one: nothing can fork away), verify."""
    t0 = time.monotonic()
    signals: list[str] = []
    never = Protected()
    refused: dict[int, str] = {}

    def allowed(found: set[int]) -> set[int]:
        for pid in found:
            if pid not in refused and (why := never.why(pid)):
                refused[pid] = why
        return found - set(refused)

    # Taken before the first signal: once a parent dies its children are re-parented and
    # the tree no longer finds them.
    targets = allowed(await asyncio.to_thread(_members, set(pids), cgroup))

    def send(sig: signal.Signals) -> None:
        # cgroup.kill takes every member: never while one of them may not be touched
        if sig == signal.SIGKILL and cgroup is not None and not refused and (cgroup / "cgroup.kill").exists():
            try:
                (cgroup / "cgroup.kill").write_text("1")
                signals.append(f"SIGKILL cgroup.kill {cgroup}")
            except OSError:
                pass
        for pid in sorted(targets):
            try:
                os.kill(pid, sig)
                signals.append(f"{sig.name} pid {pid}")
            except ProcessLookupError:
                pass

    def still_there(pids: set[int]) -> set[int]:
        """Those of `pids` alive, and whatever lives in the cgroup now (a process the
        engine forked after the first look belongs to it as much)."""
        left = {p for p in pids if _alive(p)}
        if cgroup is not None:
            try:
                left |= {p for p in allowed(set(cgroup_procs(cgroup) or ())) if _alive(p)}
            except Exception:  # noqa: BLE001 - an unreadable cgroup leaves the PIDs
                pass
        return left

    async def wait_gone(limit: float) -> set[int]:
        deadline = time.monotonic() + limit
        left = still_there(targets)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(poll)
            left = still_there(left)
        return left

    send(signal.SIGTERM)
    left = await wait_gone(grace)
    escalated = False
    if left:
        escalated = True
        # children forked during the grace period are part of the engine too
        targets |= allowed(await asyncio.to_thread(_members, left, cgroup))
        send(signal.SIGKILL)
        left = await wait_gone(after_sigkill)
    return KillResult(tuple(sorted(targets)), str(cgroup) if cgroup is not None else None, tuple(signals),
                      escalated, not left and not refused, tuple(sorted(left)), time.monotonic() - t0,
                      tuple(refused[p] for p in sorted(refused)))


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int | None
    output: str
    seconds: float

    def to_dict(self) -> dict:
        return {"argv": list(self.argv), "returncode": self.returncode, "output": self.output[-500:],
                "seconds": round(self.seconds, 3)}


async def run_command(argv: list[str], timeout: float = 60.0) -> CommandResult:
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except FileNotFoundError:
        return CommandResult(tuple(argv), None, f"{argv[0]}: not found", time.monotonic() - t0)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return CommandResult(tuple(argv), None, f"timed out after {timeout:g} s", time.monotonic() - t0)
    return CommandResult(tuple(argv), proc.returncode, out.decode(errors="replace"), time.monotonic() - t0)


def restart_argv(unit: str | None, command: list[str] | None) -> list[str] | None:
    if command:
        return list(command)
    if unit:
        return ["systemctl", "restart", unit]
    return None
