"""`gpuguard reload` (the unit's ExecReload=) returns only once the daemon has applied
the new config, and fails — the old config still running — when the file is invalid
(issue 19 defect 2: `kill -HUP` returned before the reload, seen once in three)."""
from __future__ import annotations

import os
import subprocess
import sys

from deploy_harness import REPO
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def _config(path, state, interval: float) -> None:
    path.write_text(
        f"state_dir: {state}\nrecorder: {{path: {state}/flight.sqlite}}\n"
        f"listen: {{address: 127.0.0.1, port: 0}}\npoll: {{interval_seconds: {interval}}}\nkernel: {{enabled: false}}\n"
    )


def _reload(pid: int, runtime, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", "reload", "--pid", str(pid), "--timeout", str(timeout)],
        env=dict(os.environ, PYTHONPATH=str(REPO / "daemon"), RUNTIME_DIRECTORY=str(runtime)),
        capture_output=True, text=True, timeout=timeout + 30,
    )


def test_reload_returns_after_the_new_config_is_applied_and_fails_on_an_invalid_one(tmp_path, sim_root, start_daemon):
    runtime = tmp_path / "run"
    runtime.mkdir()
    cfg = tmp_path / "gpuguard.yaml"
    _config(cfg, tmp_path / "state", 1.0)
    d = start_daemon(sim_root, cfg, env={"RUNTIME_DIRECTORY": str(runtime)})
    interval = lambda: d.get("/v1/config").json()["poll"]["interval_seconds"]  # noqa: E731
    assert interval() == 1.0

    for n, new in enumerate((0.5, 2.0, 0.75), start=1):
        _config(cfg, tmp_path / "state", new)
        r = _reload(d.pid, runtime)
        assert r.returncode == 0, r.stderr
        assert f"reload {n} of pid {d.pid}" in r.stdout
        # no polling here: the reload command returned, so the config must already be in effect
        assert interval() == new

    cfg.write_text("poll: {interval_seconds: fast}\n")
    r = _reload(d.pid, runtime)
    assert r.returncode == 1 and "config refused" in r.stderr
    assert interval() == 0.75 and d.proc.poll() is None


def test_reload_fails_when_nobody_answers(tmp_path):
    # the waiting can fail: a process that takes SIGHUP but never writes the record
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import signal,time; signal.signal(signal.SIGHUP, lambda *a: None); print('ok', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline() == "ok\n"  # its handler is in place
        r = _reload(sleeper.pid, tmp_path, timeout=1)
        assert r.returncode == 1 and "no answer in 1 s" in r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    r = _reload(sleeper.pid, tmp_path, timeout=1)
    assert r.returncode == 1 and "no process" in r.stderr
