"""Where the engine kill may never go: a pid file another user could have written (owned
by someone else, or writable by group or others), a pid file naming PID 1, a `cmdline`
regex that matches any process, gpuguard itself and its parents, kernel threads. Each is
refused with the reason and nothing is signalled: a real unrelated process tree (a shell
with two `sleep`s, the shape a root gpuguard was once aimed at) stays alive. And the
kill never signals the engine's process group: a `sleep` its launcher started beside it
lives on."""
from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpuguard.control.actions import ActionRefused
from gpuguard.control.engine_actions import EngineActions
from gpuguard.engines.config import EngineConfig, matches_any_process
from gpuguard.engines.process import ProcessLookupFailed, protected, resolve
from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, free_port, sim_env, wait_for
from support import STARTS

ME = pwd.getpwuid(os.geteuid()).pw_name


@pytest.fixture
def victim():
    """An unrelated process tree in its own session: `sh -c "sleep 600 & sleep 600 & wait"`.
    -> (the shell, [shell, sleep, sleep])"""
    p = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600 & wait"], start_new_session=True)
    tree = wait_for(lambda: (k := psutil.Process(p.pid).children()) and len(k) == 2 and [p.pid] + [c.pid for c in k],
                    STARTS, what="the victim's two sleeps")
    yield p, tree
    os.killpg(p.pid, 9)
    p.wait(5)


def _kill_through_the_api(cfg: EngineConfig) -> tuple[str, list]:
    """POST /v1/engines/NAME/kill's provider: -> (the refusal it answered 409 with, audit)."""
    audit: list = []
    wd = EngineWatchdog([cfg], audit.append, lambda e: None)
    with pytest.raises(ActionRefused) as ei:
        asyncio.run(EngineActions(wd).kill_engine(cfg.name, "api:test"))
    return str(ei.value), audit


def _pid_file(tmp_path: Path, pid: int, mode: int = 0o644) -> Path:
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    f = folder / "victim.pid"
    f.write_text(f"{pid}\n")
    os.chmod(f, mode)
    return f


@pytest.mark.root
def test_a_pid_file_owned_by_another_user_is_refused(tmp_path, victim):
    if os.geteuid() != 0:
        pytest.skip("needs root: chowns the pid file to nobody")
    shell, tree = victim
    f = _pid_file(tmp_path, shell.pid)
    os.chmod(f.parent, 0o1777)  # the world-writable folder the file was planted in
    nobody = pwd.getpwnam("nobody")
    os.chown(f, nobody.pw_uid, nobody.pw_gid)
    cfg = engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"pid_file": str(f)})
    with pytest.raises(ProcessLookupFailed) as ei:
        resolve(cfg)
    why = (f"pid file {f} is owned by nobody (uid {nobody.pw_uid}), not by root or the engine's user "
           "(process.user): anyone else may have written it; refused, nothing signalled")
    assert str(ei.value) == why
    refusal, audit = _kill_through_the_api(cfg)
    assert refusal == f"engine victim: {why}"
    assert audit == [] and all(alive(p) for p in tree)
    # the engine's own user may own its pid file, once configured
    cfg = engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"pid_file": str(f), "user": "nobody"})
    with pytest.raises(ProcessLookupFailed) as ei:
        resolve(cfg)  # ... but the process it names must then run as that user: this one is root's
    assert str(ei.value) == (f"pid file {f} names PID {shell.pid}, which runs as root (uid 0), not as the engine's "
                             "user nobody (uid 65534); refused, nothing signalled")
    assert all(alive(p) for p in tree)


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646])
def test_a_pid_file_that_group_or_others_may_write_is_refused(tmp_path, victim, mode):
    shell, tree = victim
    f = _pid_file(tmp_path, shell.pid, mode)
    cfg = engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"pid_file": str(f), "user": ME})
    why = (f"pid file {f} is writable by {'group and others' if mode & 0o022 == 0o022 else 'group' if mode & 0o020 else 'others'} "
           f"(mode {mode:04o}): anyone else may have written it; chmod go-w it; refused, nothing signalled")
    with pytest.raises(ProcessLookupFailed) as ei:
        resolve(cfg)
    assert str(ei.value) == why
    refusal, audit = _kill_through_the_api(cfg)
    assert refusal == f"engine victim: {why}" and audit == []
    assert all(alive(p) for p in tree)


def test_a_pid_file_of_the_engines_user_with_a_sound_mode_is_followed(tmp_path, victim):
    shell, tree = victim
    f = _pid_file(tmp_path, shell.pid, 0o644)
    procs = resolve(engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"pid_file": str(f), "user": ME}))
    assert procs.main_pid == shell.pid and set(procs.pids) == set(tree)


def test_a_pid_file_naming_pid_1_is_refused(tmp_path, victim):
    """PID 1's tree is every process (pytest's, the victim's): resolution refuses before any
    kill is tried, and the kill through the API says why."""
    shell, tree = victim
    f = _pid_file(tmp_path, 1)
    cfg = engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"pid_file": str(f), "user": ME})
    with pytest.raises(ProcessLookupFailed) as ei:  # first: a regression must fail here, before any signal
        resolve(cfg)
    why = f"pid file {f} names PID 1 (init), never an engine; refused, nothing signalled"
    assert str(ei.value) == why
    refusal, audit = _kill_through_the_api(cfg)
    assert refusal == f"engine victim: {why}" and audit == []
    assert all(alive(p) for p in tree) and alive(1)


def test_a_kernel_hang_kill_refused_is_not_called_gone(tmp_path, victim):
    """The kernel's kill (a GPU hang) goes through the same resolution: refused, its result
    says so — never the "gone" of an engine that had no process."""
    shell, tree = victim
    f = _pid_file(tmp_path, 1)
    cfg = engine_cfg("victim", "vllm", "http://127.0.0.1:1", gpus=["gpu0"], process={"pid_file": str(f), "user": ME})
    audit: list = []
    wd = EngineWatchdog([cfg], audit.append, lambda e: None)
    out = asyncio.run(wd.kill_engines_on_gpu("gpu0", "gpu_hang"))
    assert out == {"victim": {"gone": False, "note": "nothing signalled", "refused": [
        f"pid file {f} names PID 1 (init), never an engine; refused, nothing signalled"]}}
    assert audit == [] and all(alive(p) for p in tree)


@pytest.mark.parametrize("pattern", [".", ".*", "^", "$", "(?:)", "x*", r"\S", "[a-z]", ".+", "(?s).", r"\w|/"])
def test_a_cmdline_regex_that_matches_any_process_is_refused(pattern):
    assert matches_any_process(pattern)
    with pytest.raises(ValueError) as ei:
        engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"cmdline": pattern})
    assert (f"process.cmdline: {pattern!r} matches any process (it matches "
            in str(ei.value)) and "name the engine's own command line" in str(ei.value)


@pytest.mark.parametrize("pattern", ["vllm serve", r"--kind vllm --port 8000( |$)", "llama-server .*--port 8080", "x",
                                     "sglang"])
def test_a_cmdline_regex_naming_an_engine_is_accepted(pattern):
    assert matches_any_process(pattern) is None
    assert engine_cfg("e", "vllm", "http://127.0.0.1:1", process={"cmdline": pattern}).process.cmdline == pattern


def test_a_cmdline_regex_that_matches_any_process_is_refused_at_the_kill_too(victim):
    """A config that skipped validation (built in code, changed after loading): resolution
    still refuses the regex, and the tree it would have picked lives."""
    shell, tree = victim
    cfg = engine_cfg("victim", "vllm", "http://127.0.0.1:1", process={"cmdline": "no-such-engine"})
    cfg.process.cmdline = "."
    why = "cmdline '.' matches any process (it matches '/sbin/init'); refused, nothing signalled"
    with pytest.raises(ProcessLookupFailed) as ei:
        resolve(cfg)
    assert str(ei.value) == why
    refusal, audit = _kill_through_the_api(cfg)
    assert refusal == f"engine victim: {why}" and audit == []
    assert all(alive(p) for p in tree)


@pytest.mark.slow
def test_config_check_refuses_a_cmdline_that_matches_any_process(tmp_path):
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text("engines:\n  - name: victim\n    kind: vllm\n    url: http://127.0.0.1:8000\n"
                   "    process: {cmdline: '.'}\n")
    r = subprocess.run([sys.executable, "-m", "gpuguard", "config", "check", str(cfg)], capture_output=True,
                       text=True, timeout=120, env=sim_env())
    assert r.returncode == 1, r.stdout + r.stderr
    assert "engines[0].process" in r.stderr and "'.' matches any process" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_what_is_never_an_engine():
    assert protected(1) == "PID 1 (init)"
    assert protected(0) == "PID 0 (not a process)" and protected(-1) == "PID -1 (not a process)"
    assert protected(os.getpid()) == f"PID {os.getpid()} (gpuguard itself)"
    for parent in psutil.Process().parents():
        if parent.pid != 1:
            assert protected(parent.pid) == f"PID {parent.pid} (a parent of gpuguard: {parent.name()})"
    kthreads = [p.pid for p in psutil.process_iter() if p.pid > 1 and _is_kthread(p.pid)]
    if kthreads:  # none are visible inside some containers
        assert protected(kthreads[0]) == f"PID {kthreads[0]} (a kernel thread)"
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert protected(child.pid) is None
    finally:
        child.kill()
        child.wait(5)


def _is_kthread(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return bool(int(raw[raw.rfind(")") + 2:].split()[6]) & 0x00200000)


KILL_MY_PARENT = """
import asyncio, json, os
from gpuguard.engines.actions import kill_engine
res = asyncio.run(kill_engine((os.getppid(),), 0.5, after_sigkill=0.5))
print(json.dumps(res.to_dict()), flush=True)
"""


@pytest.mark.slow
def test_the_kill_never_signals_gpuguards_own_parents():
    """A kill aimed at the process that started gpuguard (its shell): refused at the
    signal itself, the result says so and not "gone"; the shell lives to say it did."""
    r = subprocess.run(["sh", "-c", f"{sys.executable} -c '{KILL_MY_PARENT}'; echo shell-alive"], capture_output=True,
                       text=True, timeout=120, env=sim_env())
    out = r.stdout.splitlines()
    assert out and out[-1] == "shell-alive", r.stdout + r.stderr
    res = json.loads(out[0])
    assert res["gone"] is False and res["signals"] == [] and res["pids"] == [], res
    # the shell's tree holds gpuguard too
    assert [r.split(" ", 2)[2] for r in res["refused"]] == ["(a parent of gpuguard: sh)", "(gpuguard itself)"], res


BY_CMDLINE_UNDER_A_PARENT = """
import re, psutil
from gpuguard.engines.process import _by_cmdline
me = " ".join(psutil.Process().cmdline())
print(_by_cmdline(re.escape(me) + "$"), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [["timeout", "120"], ["nice", "-n", "0"]])
def test_a_cmdline_match_is_never_a_parent_of_gpuguard(launcher):
    """Started as `timeout 120 python -c …` (CI starts pytest that way): the parent's
    command line ends with gpuguard's own and matches; it is gpuguard's parent, never the
    engine (a kill would take gpuguard and the run with it)."""
    argv = [*launcher, sys.executable, "-c", BY_CMDLINE_UNDER_A_PARENT]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=sim_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None", f"picked PID {r.stdout.strip()}: {' '.join(argv[:3])}"


@pytest.mark.slow
@pytest.mark.network
def test_the_kill_never_signals_the_launchers_process_group():
    """`sh -c "engine & sleep 600 & wait"` (its own session and group, like a unit or a
    login): killing the engine leaves the shell and its other job alive."""
    port = free_port()
    launcher = subprocess.Popen(
        ["sh", "-c", f"{sys.executable} -m gpuguard.sim.engines --kind vllm --port {port} & sleep 600 & wait"],
        env=sim_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = wait_for(lambda: next((c for c in psutil.Process(launcher.pid).children()
                                        if c.cmdline()[:3] == [sys.executable, "-m", "gpuguard.sim.engines"]), None),
                          STARTS, what="the engine started")
        sleeper = wait_for(lambda: next((c for c in psutil.Process(launcher.pid).children() if c.name() == "sleep"),
                                        None), STARTS, what="the sleep started")
        wait_for(lambda: len(engine.children()) == 1, STARTS, what="the engine's EngineCore")
        tree = [engine.pid] + [c.pid for c in engine.children(recursive=True)]
        assert {os.getpgid(p) for p in tree + [sleeper.pid]} == {launcher.pid}  # one group
        cfg = engine_cfg("v", "vllm", f"http://127.0.0.1:{port}", grace=1.0,
                         process={"cmdline": rf"gpuguard\.sim\.engines --kind vllm --port {port}( |$)"})
        wd = EngineWatchdog([cfg], lambda r: None, lambda e: None)
        res = asyncio.run(EngineActions(wd).kill_engine("v", "api:test"))
        assert res["gone"] and set(res["pids"]) == set(tree), res
        wait_for(lambda: not any(alive(p) for p in tree), 10, what="the engine's processes gone")
        assert alive(sleeper.pid), "the launcher's sleep (same process group) was signalled"
        assert alive(launcher.pid)
    finally:
        os.killpg(launcher.pid, 9)
        launcher.wait(5)
