"""A stand-in for systemd's `Restart=always` in tests and the demo (no systemd in CI):
runs the engine command, starts it again `--restart-sec` after every exit, each run in its
own session (as a unit's cgroup), until SIGTERM. SIGHUP restarts the engine at once (SIGKILL
and start again), like `systemctl restart` — what a test's `restart_command` sends.
`--parent PID` ties it to the process that started it: when that one exits, however it
ends, the stand-in stops and takes the engine with it (as a unit stops with its manager).

    python -m gpuguard.sim.engines_restart [--restart-sec S] [--parent PID] -- CMD ARGS..."""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time


def _death_signal(sig: int) -> None:
    """The kernel sends `sig` to this process when the thread that started it exits."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _die_with_parent(parent: int) -> None:
    """A test stand-in must not leak engines: the child dies if this supervisor does."""
    _death_signal(signal.SIGKILL)
    # The supervisor may have been stopped between the fork and the prctl (a stop during
    # a restart): the death signal is then never sent, so check for it by hand.
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuguard.sim.engines_restart")
    p.add_argument("--restart-sec", type=float, default=0.2)
    p.add_argument("--parent", type=int, metavar="PID",
                   help="stop, killing the engine, when process PID (the one that started this) exits")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command after --")
    child: list[subprocess.Popen] = []

    def stop(*_):
        for c in child:
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    def restart(*_):
        for c in child:
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    me = os.getpid()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, restart)
    if a.parent:
        # Armed after the handlers, so the death signal runs `stop`; a parent already gone
        # before it was armed is seen here instead.
        _death_signal(signal.SIGTERM)
        if os.getppid() != a.parent:
            stop()
    while True:
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: _die_with_parent(me))
        child[:] = [proc]
        proc.wait()
        time.sleep(a.restart_sec)


if __name__ == "__main__":
    sys.exit(main())
