"""What the watchdog does to an engine: kill (SIGTERM to its process group, SIGKILL after the
grace period, verify every process is gone) and restart (`systemctl restart UNIT`, a
configured command, or kill and let the service manager's Restart= bring it back).
Async: waiting out a grace period never blocks the event loop."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import psutil

from gpuguard.engines.process import read_proc_stat


@dataclass(frozen=True)
class KillResult:
    pids: tuple[int, ...]
    pgid: int | None
    signals: tuple[str, ...]  # in order: "SIGTERM pgid 123", "SIGKILL pid 124", ...
    escalated: bool  # SIGKILL was needed (ignored SIGTERM, or stopped: SIGTERM never arrives)
    gone: bool
    survivors: tuple[int, ...]
    seconds: float

    def to_dict(self) -> dict:
        return {"pids": list(self.pids), "pgid": self.pgid, "signals": list(self.signals),
                "escalated": self.escalated, "gone": self.gone, "survivors": list(self.survivors),
                "seconds": round(self.seconds, 3)}


def _alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            _reap(pid)
            return False
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _reap(pid: int) -> None:
    """A zombie that is our own child (tests, `gpuguard demo`) is gone once reaped."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _group_members(pgid: int) -> set[int]:
    out = set()
    for p in psutil.process_iter(["pid"]):
        st = read_proc_stat(p.pid)
        if st is not None and st.pgid == pgid and st.state != "Z":
            out.add(p.pid)
    return out


async def kill_engine(pids: tuple[int, ...], grace: float, *, poll: float = 0.02,
                      after_sigkill: float = 5.0) -> KillResult:
    """SIGTERM the engine's process group (or each PID when the group is ours or init's:
    never signal gpuguard itself), wait up to `grace`, SIGKILL what is left, verify."""
    t0 = time.monotonic()
    signals: list[str] = []
    main = pids[0]
    st = read_proc_stat(main)
    pgid = st.pgid if st is not None else None
    own_pgid = os.getpgid(0)
    use_group = pgid is not None and pgid > 1 and pgid != own_pgid
    targets = set(pids)
    if use_group:
        targets |= await asyncio.to_thread(_group_members, pgid)
    targets.discard(os.getpid())

    def send(sig: signal.Signals) -> None:
        if use_group:
            try:
                os.killpg(pgid, sig)
                signals.append(f"{sig.name} pgid {pgid}")
            except ProcessLookupError:
                pass
        for pid in sorted(targets):
            # Members outside the group (a child that called setsid) still get the signal.
            if use_group and (s := read_proc_stat(pid)) is not None and s.pgid == pgid:
                continue
            try:
                os.kill(pid, sig)
                signals.append(f"{sig.name} pid {pid}")
            except ProcessLookupError:
                pass

    async def wait_gone(limit: float) -> set[int]:
        deadline = time.monotonic() + limit
        left = {p for p in targets if _alive(p)}
        while left and time.monotonic() < deadline:
            await asyncio.sleep(poll)
            left = {p for p in left if _alive(p)}
        return left

    send(signal.SIGTERM)
    left = await wait_gone(grace)
    escalated = False
    if left:
        escalated = True
        send(signal.SIGKILL)
        left = await wait_gone(after_sigkill)
    return KillResult(tuple(sorted(targets)), pgid if use_group else None, tuple(signals), escalated,
                      not left, tuple(sorted(left)), time.monotonic() - t0)


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
