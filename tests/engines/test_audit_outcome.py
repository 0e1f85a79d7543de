"""Each engine action's audit record says what really happened, through the daemon's real
audit log: a kill "gone" (or "not gone", with why), a restart command that exits 1
"failed" with its exit code, one that is not there "failed" saying so, one that ran "ok"
while the engine comes back. Real processes, real commands, the real AuditLog."""
from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from gpuguard.engines.watchdog import EngineWatchdog
from gpuguard.state.audit import AuditLog

from engines_harness import alive, engine_cfg


@pytest.fixture
def sleeper(tmp_path):
    p = subprocess.Popen(["sleep", "600"])
    pid_file = tmp_path / "e.pid"
    pid_file.write_text(f"{p.pid}\n")
    os.chmod(pid_file, 0o644)
    yield p, pid_file
    p.kill()
    p.wait(5)


def _watchdog(tmp_path, pid_file, restart_command=None):
    log = AuditLog(tmp_path / "audit.jsonl")
    cfg = engine_cfg("e", "vllm", "http://127.0.0.1:1", grace=1.0, restart_command=restart_command,
                     process={"pid_file": str(pid_file), "user": str(os.geteuid())})
    return EngineWatchdog([cfg], log.engine_action, lambda e: None), log


@pytest.mark.parametrize("argv,result,returncode", [
    (["sh", "-c", "echo no >&2; exit 1"], "failed: restart command exited 1", 1),
    (["sh", "-c", "exit 3"], "failed: restart command exited 3", 3),
    (["/nonexistent/restart-engine"], "failed: restart command /nonexistent/restart-engine: not found", None),
    (["true"], "ok: command ran; waiting up to 900 s for a new ready process", 0),
])
def test_a_restart_is_audited_with_what_its_command_did(tmp_path, sleeper, argv, result, returncode):
    _, pid_file = sleeper
    wd, log = _watchdog(tmp_path, pid_file, argv)
    asyncio.run(wd.restart_asked("e", "api:alice"))
    (rec,) = list(log)
    assert (rec["what"], rec["who"], rec["target"], rec["result"]) == ("engine.restart", "api:alice", "e", result)
    assert rec["evidence"]["returncode"] == returncode
    assert rec["evidence"]["result"]["command"]["returncode"] == returncode


def test_a_kill_is_audited_gone(tmp_path, sleeper):
    p, pid_file = sleeper
    wd, log = _watchdog(tmp_path, pid_file)
    res = asyncio.run(wd.kill_asked("e", "api:alice"))
    assert res.gone and not alive(p.pid)
    (rec,) = list(log)
    assert (rec["what"], rec["result"]) == ("engine.kill", "gone")
    assert rec["evidence"]["result"]["pids"] == [p.pid]


def test_the_watchdogs_own_kill_goes_ahead_when_its_record_cannot_be_written(tmp_path, sleeper, caplog):
    """A full or broken state folder must not keep a hung engine alive: the safety kill (a
    GPU hang here) runs, and the record it could not write is in the log whole."""
    p, pid_file = sleeper
    (tmp_path / "audit.jsonl").mkdir()  # the audit log's path cannot be written
    log = AuditLog(tmp_path / "audit.jsonl")
    cfg = engine_cfg("e", "vllm", "http://127.0.0.1:1", grace=1.0, gpus=["gpu0"],
                     process={"pid_file": str(pid_file), "user": str(os.geteuid())})
    wd = EngineWatchdog([cfg], log.engine_action, lambda e: None)
    with caplog.at_level("ERROR", logger="gpuguard.audit"):
        out = asyncio.run(wd.kill_engines_on_gpu("gpu0", "gpu_hang"))
    assert out["e"]["gone"] and not alive(p.pid)
    (line,) = [r.getMessage() for r in caplog.records if "audit record not written" in r.getMessage()]
    assert '"what": "engine.kill"' in line and '"result": "gone"' in line
