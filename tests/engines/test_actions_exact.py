"""The watchdog's kill and restart commands on real processes this test starts (real
signals, real exits): exactly which PIDs get which signal in which order, when SIGKILL is
needed, what is reported, and what a restart command returns — its output, exit code,
a missing program, a timeout. bench/mutation.sh found these results unobserved."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuguard.engines.actions import CommandResult, KillResult, kill_engine, restart_argv, run_command
from engines_harness import ZOMBIE_LEADER, alive
from support import poll_until


def spawn(code: str, *args: str) -> subprocess.Popen:
    """A Python child that prints `ready` once its signal handling is set up."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


IGNORES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
SLEEPS = "import time; print('ready', flush=True); time.sleep(60)"


@pytest.fixture
def started():
    procs: list[subprocess.Popen] = []

    def start(code: str = SLEEPS, *args: str) -> subprocess.Popen:
        p = spawn(code, *args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5)


def test_restart_argv():
    assert restart_argv(None, ["/usr/bin/engine", "--port", "1"]) == ["/usr/bin/engine", "--port", "1"]
    assert restart_argv("vllm.service", ["/bin/x"]) == ["/bin/x"]  # a command wins over the unit
    assert restart_argv("vllm.service", None) == ["systemctl", "restart", "vllm.service"]
    assert restart_argv(None, None) is None and restart_argv(None, []) is None


def test_a_command_result_with_its_output_and_exit_code():
    t0 = time.monotonic()
    r = asyncio.run(run_command(["sh", "-c", "echo out; echo err >&2; exit 3"]))
    took = time.monotonic() - t0
    assert (r.argv, r.returncode, r.output) == (("sh", "-c", "echo out; echo err >&2; exit 3"), 3, "out\nerr\n")
    assert 0 <= r.seconds <= took


def test_a_command_result_as_a_record_keeps_the_last_500_characters():
    r = CommandResult(("x",), 0, "a" * 100 + "b" * 500, 1.23456)
    assert r.to_dict() == {"argv": ["x"], "returncode": 0, "output": "b" * 500, "seconds": 1.235}


def test_output_that_is_not_utf8_is_kept_readable():
    r = asyncio.run(run_command(["sh", "-c", r"printf 'ok\377\n'"]))
    assert r.output == "ok\ufffd\n"


def test_a_missing_program():
    t0 = time.monotonic()
    r = asyncio.run(run_command(["/nonexistent/restart-engine", "now"]))
    assert (r.argv, r.returncode, r.output) == (("/nonexistent/restart-engine", "now"), None,
                                                "/nonexistent/restart-engine: not found")
    assert 0 <= r.seconds <= time.monotonic() - t0


def test_a_command_that_hangs_is_killed_at_its_timeout(tmp_path):
    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    r = asyncio.run(run_command(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"], timeout=0.3))
    assert (r.returncode, r.output) == (None, "timed out after 0.3 s")
    assert r.argv == ("sh", "-c", f"echo $$ > {pidfile}; exec sleep 30")
    assert 0.3 <= r.seconds <= time.monotonic() - t0
    assert not psutil.pid_exists(int(pidfile.read_text())) or \
        psutil.Process(int(pidfile.read_text())).status() == psutil.STATUS_ZOMBIE


def test_the_default_command_timeout_is_a_minute():
    import inspect

    assert inspect.signature(run_command).parameters["timeout"].default == 60.0


def test_kill_result_record():
    k = KillResult((4, 5), "/sys/fs/cgroup/x.scope", ("SIGTERM pid 4",), True, False, (5,), 0.12345)
    assert k.to_dict() == {"pids": [4, 5], "cgroup": "/sys/fs/cgroup/x.scope", "signals": ["SIGTERM pid 4"],
                           "escalated": True, "gone": False, "survivors": [5], "seconds": 0.123, "refused": []}
    k = KillResult((4,), None, ("SIGTERM pid 4",), False, False, (), 0.1, ("PID 1 (init)",))
    assert k.to_dict()["refused"] == ["PID 1 (init)"]


def test_sigterm_is_enough_for_a_process_that_takes_it(started):
    p = started()
    t0 = time.monotonic()
    res = asyncio.run(kill_engine((p.pid,), grace=5.0))
    assert res == KillResult((p.pid,), None, (f"SIGTERM pid {p.pid}",), False, True, (), res.seconds)
    assert 0 < res.seconds < time.monotonic() - t0 + 0.001 and res.seconds < 4.0
    p.wait(5)  # reaped by the kill (our own child): gone


def test_sigkill_after_the_grace_for_one_that_ignores_sigterm(started):
    p = started(IGNORES_TERM)
    res = asyncio.run(kill_engine((p.pid,), grace=0.3))
    assert (res.pids, res.signals, res.escalated, res.gone, res.survivors) == (
        (p.pid,), (f"SIGTERM pid {p.pid}", f"SIGKILL pid {p.pid}"), True, True, ())
    assert 0.3 <= res.seconds < 4.0
    p.wait(5)


def test_a_stopped_process_gets_sigkill(started):
    p = started()
    os.kill(p.pid, signal.SIGSTOP)
    # stopped before the SIGTERM comes: with both pending the kernel takes the lower-numbered
    # SIGTERM first, and a process not yet scheduled since the SIGSTOP would just exit
    poll_until(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED, timeout=30, what="the process stopped")
    res = asyncio.run(kill_engine((p.pid,), grace=0.2))
    assert (res.signals, res.escalated, res.gone) == ((f"SIGTERM pid {p.pid}", f"SIGKILL pid {p.pid}"), True, True)


def test_a_process_whose_leader_thread_ended_is_alive_until_its_last_thread_is(started):
    p = started(ZOMBIE_LEADER)
    poll_until(lambda: psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE, timeout=30,
               what="the leader thread ended")
    res = asyncio.run(kill_engine((p.pid,), grace=0.2))
    assert (res.signals, res.escalated) == ((f"SIGTERM pid {p.pid}", f"SIGKILL pid {p.pid}"), True)
    assert res.gone and not os.path.exists(f"/proc/{p.pid}")   # our child: reaped by the kill


def test_the_whole_tree_in_pid_order_and_never_ourselves(started):
    parent = started("import subprocess, sys, time\n"
                     "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(2)]\n"
                     "print('ready', flush=True)\n"
                     "time.sleep(60)")
    kids = sorted(c.pid for c in psutil.Process(parent.pid).children())
    assert len(kids) == 2
    # a SIGTERM to this process fails the test here (raised in the kill's own frame, before
    # any SIGKILL) instead of ending the whole test run
    def signalled_us(sig, frame):
        raise AssertionError(f"kill_engine sent {signal.Signals(sig).name} to the test process itself")

    previous = signal.signal(signal.SIGTERM, signalled_us)
    try:
        res = asyncio.run(kill_engine((parent.pid, os.getpid()), grace=5.0))
    finally:
        signal.signal(signal.SIGTERM, previous)
    everyone = tuple(sorted([parent.pid, *kids]))
    assert res.pids == everyone and os.getpid() not in res.pids
    assert res.signals == tuple(f"SIGTERM pid {p}" for p in everyone)
    # what it refused to touch is said, and the engine is not called "gone" with it
    assert (res.escalated, res.gone, res.survivors, res.refused) == (
        False, False, (), (f"PID {os.getpid()} (gpuguard itself)",))
    assert not any(alive(p) for p in everyone)


def test_a_pid_already_gone_is_not_signalled(started):
    p = started()
    p.kill()
    p.wait(5)
    res = asyncio.run(kill_engine((p.pid,), grace=0.2))
    assert (res.signals, res.gone, res.escalated) == ((), True, False)



def test_the_kill_looks_every_20_ms_so_it_ends_soon_after_the_engine(started):
    """An engine that takes 0.1 s to exit on SIGTERM: the kill sees it gone within a few
    20 ms looks, not a second later (the watchdog's kill time is in its audit record)."""
    p = started("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.1), sys.exit(0)))\n"
                "print('ready', flush=True)\n"
                "time.sleep(60)")
    res = asyncio.run(kill_engine((p.pid,), grace=5.0))
    assert (res.signals, res.escalated, res.gone) == ((f"SIGTERM pid {p.pid}",), False, True)
    assert 0.1 <= res.seconds < 0.9, res.seconds


def test_the_default_wait_after_sigkill_is_five_seconds():
    import inspect

    assert inspect.signature(kill_engine).parameters["after_sigkill"].default == 5.0


# A process that, on SIGTERM, leaves a detached sleeper behind (double fork: not in its
# tree), lists it in the cgroup folder's cgroup.procs and then exits or, with IGNORE, goes on.
LEAVES_A_STRAGGLER = """
import signal, subprocess, sys, time
procs, ignore = sys.argv[1], sys.argv[2] == "ignore"
def on_term(*_):
    mid = subprocess.run([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"],
        capture_output=True, text=True)
    with open(procs, "a") as f:
        f.write(mid.stdout.strip() + "\\n")
    if not ignore:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _straggler(procs: Path, before: str) -> int:
    return int(procs.read_text().split()[len(before.split())])


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# A chain of N processes below the one started: each level starts the next and says `ready`
# once everything below it has.
CHAIN = """
import subprocess, sys, time
depth, me = int(sys.argv[1]), sys.argv[2]
if depth:
    below = subprocess.Popen([sys.executable, "-c", me, str(depth - 1), me], stdout=subprocess.PIPE, text=True)
    below.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def test_the_tree_is_every_descendant_not_only_the_children(started):
    """An engine's worker's worker (vLLM: API server -> engine core -> its helpers) is killed
    with it: the tree goes all the way down."""
    top = started(CHAIN, "3", CHAIN)
    chain = [psutil.Process(top.pid)]
    while len(chain) < 4:
        (below,) = chain[-1].children()
        chain.append(below)
    res = asyncio.run(kill_engine((top.pid,), grace=5.0))
    everyone = tuple(sorted(p.pid for p in chain))
    assert res.pids == everyone
    assert res.signals == tuple(f"SIGTERM pid {p}" for p in everyone)
    assert (res.escalated, res.gone, res.survivors) == (False, True, ())


def test_the_processes_reported_after_sigkill_include_those_sigterm_ended(started):
    """The SIGKILL round adds what appeared during the grace to the engine's processes; the
    ones SIGTERM already ended stay in the report."""
    stubborn, obliging = started(IGNORES_TERM), started()
    res = asyncio.run(kill_engine((stubborn.pid, obliging.pid), grace=2.0))
    both = tuple(sorted([stubborn.pid, obliging.pid]))
    assert res.pids == both
    assert res.signals == (*(f"SIGTERM pid {p}" for p in both), f"SIGKILL pid {stubborn.pid}")
    assert (res.escalated, res.gone, res.survivors) == (True, True, ())


def test_the_tree_reaches_grandchildren_and_a_pid_already_gone_stops_nothing(started):
    """The tree below a PID in the middle; a PID that no longer exists, iterated first, does not end
    the walk of the others."""
    parent = started("import subprocess, sys, time\n"
                     "child = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; "
                     "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"]); "
                     "print(\"ready\", flush=True); time.sleep(60)'], stdout=subprocess.PIPE, text=True)\n"
                     "child.stdout.readline()\n"
                     "print('ready', flush=True)\n"
                     "time.sleep(60)")
    (child,) = psutil.Process(parent.pid).children()
    (grandchild,) = child.children()
    # beyond any pid_max (2**22): never a process; the low bits put it first in the set
    gone = (child.pid & ~31) + 2 ** 23
    # the middle of the tree: it and what is below it, not its parent (this test's child)
    res = asyncio.run(kill_engine((gone, child.pid), grace=5.0))
    everyone = tuple(sorted([child.pid, grandchild.pid]))
    assert res.pids == tuple(sorted([gone, *everyone]))
    assert res.signals == tuple(f"SIGTERM pid {p}" for p in everyone)
    assert (res.escalated, res.gone, res.survivors) == (False, True, ())
    assert parent.poll() is None   # untouched


def test_the_cgroup_members_are_signalled_and_dead_ones_listed_count_as_gone(started, tmp_path):
    """Members listed in the cgroup folder's cgroup.procs get the signal with the tree; a
    listed PID that is gone by the end is no survivor."""
    main, other = started(), started()
    folder = tmp_path / "engine.scope"
    folder.mkdir()
    (folder / "cgroup.procs").write_text(f"{main.pid}\n{other.pid}\n")
    res = asyncio.run(kill_engine((main.pid,), grace=5.0, cgroup=folder))
    both = tuple(sorted([main.pid, other.pid]))
    assert (res.pids, res.cgroup) == (both, str(folder))
    assert res.signals == tuple(f"SIGTERM pid {p}" for p in both)
    assert (res.escalated, res.gone, res.survivors) == (False, True, ())
    assert not psutil.pid_exists(other.pid)  # ended by the SIGTERM and reaped by the kill


def test_a_process_that_joins_the_cgroup_during_the_grace_is_waited_for_and_killed(started, tmp_path):
    """The engine exits on SIGTERM but leaves a process in its cgroup (outside its tree):
    the engine is not gone while that one lives — after the grace it gets SIGKILL. (Until
    the kill waited on the cgroup itself, this came back "not gone, a survivor" at once.)"""
    folder = tmp_path / "engine.scope"
    folder.mkdir()
    procs = folder / "cgroup.procs"
    main = started(LEAVES_A_STRAGGLER.replace("sys.argv[1], sys.argv[2]", f"{str(procs)!r}, 'exit'"))
    procs.write_text(f"{main.pid}\n")
    res = asyncio.run(kill_engine((main.pid,), grace=1.0, cgroup=folder))
    straggler = _straggler(procs, f"{main.pid}")
    try:
        assert res.pids == (main.pid, straggler)
        assert res.signals == (f"SIGTERM pid {main.pid}", f"SIGKILL pid {straggler}")
        assert (res.escalated, res.gone, res.survivors) == (True, True, ())
        assert not alive(straggler)
    finally:
        _stop(straggler)


def test_after_the_grace_the_cgroup_is_read_again_and_what_joined_it_gets_sigkill(started, tmp_path):
    """A process that ignores SIGTERM and, meanwhile, starts one outside its tree in the same
    cgroup: the SIGKILL round reads the cgroup again and kills both."""
    folder = tmp_path / "engine.scope"
    folder.mkdir()
    procs = folder / "cgroup.procs"
    main = started(LEAVES_A_STRAGGLER.replace("sys.argv[1], sys.argv[2]", f"{str(procs)!r}, 'ignore'"))
    helper = started()   # takes SIGTERM: gone before the SIGKILL round, still one of the engine's
    procs.write_text(f"{main.pid}\n{helper.pid}\n")
    (folder / "cgroup.kill").write_text("")   # cgroup v2's kill switch (here a plain file)
    res = asyncio.run(kill_engine((main.pid,), grace=1.0, cgroup=folder))
    straggler = _straggler(procs, f"{main.pid} {helper.pid}")
    try:
        first = tuple(sorted([main.pid, helper.pid]))
        assert res.pids == tuple(sorted([main.pid, helper.pid, straggler]))
        assert res.signals == (*(f"SIGTERM pid {p}" for p in first), f"SIGKILL cgroup.kill {folder}",
                               *(f"SIGKILL pid {p}" for p in sorted([main.pid, straggler])))
        assert (res.escalated, res.gone, res.survivors) == (True, True, ())
        assert (folder / "cgroup.kill").read_text() == "1"
    finally:
        _stop(straggler)
