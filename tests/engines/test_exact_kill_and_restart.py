"""Issue 13: a kill takes exactly the engine — its process tree, or its cgroup — never a
bystander in its session; `action: restart` needs a way to restart, and a restart that
does not bring the engine back is `engine_restart_failed`."""
from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from gpuguard.engines.actions import kill_engine
from gpuguard.engines.watchdog import EngineWatchdog

from support import STARTS

from engines_harness import DAEMON, ZOMBIE_LEADER, alive, engine_cfg, free_port, run_watchdog_until, sim_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.network]  # registered in pyproject.toml


CGROUP2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() else Path("/sys/fs/cgroup")


def _session_with_bystander(port: int) -> subprocess.Popen:
    """A shell (its own session, like a login or a unit) that starts the engine and, beside
    it, a `sleep` that is no child of the engine."""
    script = (f"sleep 300 & {sys.executable} -m gpuguard.sim.engines --kind vllm --port {port} & wait")
    return subprocess.Popen(["sh", "-c", script], env=sim_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_bystander_in_the_engines_session_survives_the_kill():
    port = free_port()
    shell = _session_with_bystander(port)
    try:
        import psutil
        # by its argv after exec: a child the shell has forked but not yet exec'd still has
        # the shell's command line, which names the engine too (the bystander `sleep` was
        # taken for the engine that way in a clean CI run, and had no EngineCore to wait for)
        engine = wait_for(lambda: next((c for c in psutil.Process(shell.pid).children()
                                        if c.cmdline()[:3] == [sys.executable, "-m", "gpuguard.sim.engines"]), None),
                          STARTS, what="engine started")
        sleeper = wait_for(lambda: next((c for c in psutil.Process(shell.pid).children() if c.name() == "sleep"), None),
                           STARTS, what="the bystander started")
        wait_for(lambda: len(engine.children()) == 1, STARTS, what="EngineCore child")
        tree = [engine.pid] + [c.pid for c in engine.children(recursive=True)]
        cfg = engine_cfg("v", "vllm", f"http://127.0.0.1:{port}", grace=1.0,
                         process={"cmdline": rf"gpuguard\.sim\.engines --kind vllm --port {port}( |$)"})
        audit: list = []
        wd = EngineWatchdog([cfg], audit.append, lambda e: None)
        from gpuguard.control.engine_actions import EngineActions

        res = asyncio.run(EngineActions(wd).kill_engine("v", "test"))
        assert res["gone"] and set(res["pids"]) == set(tree), res
        wait_for(lambda: not any(alive(p) for p in tree), 5, what="engine tree gone")
        assert alive(sleeper.pid) and alive(shell.pid)  # same session, not the engine: untouched
        assert not any(s.startswith("SIGTERM pgid") for s in res["signals"])
    finally:
        os.killpg(shell.pid, 9)
        shell.wait(5)


@pytest.fixture
def scope():
    if os.geteuid() != 0 or not os.access(CGROUP2, os.W_OK):
        pytest.skip(f"needs root and a writable cgroup v2 tree at {CGROUP2}")
    folder = CGROUP2 / f"gpuguard-test-{uuid.uuid4().hex[:8]}.scope"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {CGROUP2}: {exc}")
    yield folder
    for pid in (folder / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
    wait_for(lambda: not (folder / "cgroup.procs").read_text().split(), 10, what="cgroup empty")

    def removed() -> bool:
        # EBUSY while the killed tasks still finish exiting (cgroup v2 stays populated until
        # they are reaped, after cgroup.procs already lists none: seen on a clean CI run)
        try:
            folder.rmdir()
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            return False
        return True

    wait_for(removed, 30, what=f"{folder} removable")


def test_engine_in_a_transient_scope_is_killed_through_its_cgroup(scope):
    """Like `systemd-run --scope`: the engine and a helper that is not its child share the
    cgroup; both die through it (cgroup.kill), a bystander outside it does not."""
    port = free_port()
    script = (f"echo $$ > {scope}/cgroup.procs && (sleep 300 &) && "
              f"exec {sys.executable} -m gpuguard.sim.engines --kind vllm --port {port} --ignore-sigterm")
    unit = subprocess.Popen(["sh", "-c", script], env=sim_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outside = subprocess.Popen(["sleep", "300"], start_new_session=False)
    try:
        members = wait_for(lambda: (m := (scope / "cgroup.procs").read_text().split()) and len(m) >= 3 and m, STARTS,
                           what="engine, its EngineCore and the helper in the scope")
        cfg = engine_cfg("v", "vllm", f"http://127.0.0.1:{port}", grace=0.5, process={"cgroup": str(scope)})
        audit: list = []
        wd = EngineWatchdog([cfg], audit.append, lambda e: None)
        from gpuguard.control.engine_actions import EngineActions

        res = asyncio.run(EngineActions(wd).kill_engine("v", "test"))
        assert res["gone"] and res["cgroup"] == str(scope), res
        assert set(int(p) for p in members) <= set(res["pids"]), (members, res)
        assert any(s.startswith("SIGKILL cgroup.kill") for s in res["signals"])  # it ignored SIGTERM
        assert (scope / "cgroup.procs").read_text().split() == []
        assert alive(outside.pid)
        assert audit[0]["result"]["cgroup"] == str(scope)
    finally:
        outside.kill()
        outside.wait(5)
        unit.wait(5)


def test_a_cgroup_member_whose_main_thread_ended_is_killed_and_waited_for(scope):
    """A member of the engine's cgroup whose leader thread has ended (psutil calls it a
    zombie) but whose other thread runs on and ignores SIGTERM: not "gone" — SIGKILL
    through the cgroup, and "gone" only once the cgroup is empty. A SIGKILL'd
    multi-threaded engine passes through this state while its threads exit: CI once saw
    the kill report "gone" with the engine still listed in cgroup.procs."""
    script = f"echo $$ > {scope}/cgroup.procs && exec {sys.executable} -c \"$0\""
    unit = subprocess.Popen(["sh", "-c", script, ZOMBIE_LEADER], stdout=subprocess.PIPE, text=True)
    try:
        assert unit.stdout.readline().strip() == "ready"
        wait_for(lambda: psutil.Process(unit.pid).status() == psutil.STATUS_ZOMBIE, STARTS,
                 what="the leader thread ended")
        assert (scope / "cgroup.procs").read_text().split() == [str(unit.pid)]
        res = asyncio.run(kill_engine((unit.pid,), grace=0.3, cgroup=scope))
        assert res.escalated and any(s.startswith("SIGKILL cgroup.kill") for s in res.signals), res
        assert res.gone and res.survivors == ()
        assert (scope / "cgroup.procs").read_text().split() == []
    finally:
        unit.kill()
        unit.wait(5)


def test_restart_without_a_way_fails_config_check(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("engines:\n  - name: e\n    kind: vllm\n    url: http://127.0.0.1:8000\n"
                   "    process: {cmdline: 'vllm serve'}\n    action: restart\n")
    env = {**os.environ, "PYTHONPATH": str(DAEMON)}
    r = subprocess.run([sys.executable, "-m", "gpuguard", "config", "check", str(cfg)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and "action restart needs a way to restart" in r.stderr, r.stderr
    cfg.write_text(cfg.read_text() + "    restart_command: [systemctl, restart, vllm]\n")
    r = subprocess.run([sys.executable, "-m", "gpuguard", "config", "check", str(cfg)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_restart_that_does_not_come_back_is_restart_failed(sims, tmp_path):
    """The restart command 'succeeds' (exit 0) but nothing brings the engine back."""
    sim = sims("llamacpp")
    sim.control("requests", count=1)
    cfg = engine_cfg("e", "llamacpp", sim.url, process={"cmdline": rf"--kind llamacpp --port {sim.port}( |$)"},
                     poll_interval=0.2, http_timeout=0.4, stall_after=1.0, action="restart", grace=0.5,
                     ready_timeout=3.0, restart_command=["kill", "-KILL", str(sim.pid)])
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("e")) and s.state == "busy", 20)
        await asyncio.to_thread(sim.control, "stall")
        return await run_watchdog_until(wd, lambda: [e for e in events if e.kind == "engine_restart_failed"], 30)

    failed = asyncio.run(scenario())
    assert failed, [e.message for e in events]
    assert "did not come back within 3 s" in failed[0].message and "no process" in failed[0].message
    kinds = [e.kind for e in events]
    assert "engine_restarting" in kinds and "engine_restarted" not in kinds
    outcomes = [r["result"].get("outcome") for r in audit if r["what"] == "restart"]
    assert outcomes[0].startswith("command ran") and outcomes[-1] == "did not come back"


def test_restart_command_that_fails_is_restart_failed(sims):
    sim = sims("llamacpp")
    cfg = engine_cfg("e", "llamacpp", sim.url, process={"cmdline": rf"--kind llamacpp --port {sim.port}( |$)"},
                     action="restart", restart_command=["false"])
    events: list = []
    wd = EngineWatchdog([cfg], lambda r: None, events.append)
    from gpuguard.control.engine_actions import EngineActions

    from gpuguard.control.actions import ActionRefused

    # the API answers 409 with the command's exit code, never "ok" for a restart that did not happen
    with pytest.raises(ActionRefused, match="^engine e: restart command false exited 1$"):
        asyncio.run(EngineActions(wd).restart_engine("e", "test"))
    assert [e.kind for e in events] == ["engine_restart_failed"]
