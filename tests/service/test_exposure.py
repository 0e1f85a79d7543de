"""Issue 12 item 9: reads or the API reachable from the network without a token are
said out loud — a warning in the daemon's log at start and a WARN line in `doctor`."""
from __future__ import annotations

import os
import subprocess
import sys

from service.failsafe_harness import REPO, GuardProcess, sim_root
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def test_daemon_warns_at_start_when_reads_are_open_to_the_network(tmp_path, wait):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nrecorder: {{path: {tmp_path}/f.sqlite}}\n"
                   "listen: {address: 0.0.0.0, port: 0}\napi: {open_reads: true}\n")
    d = GuardProcess(cfg, sim_root(tmp_path))
    try:
        d.find_base(wait)
        (line,) = d.log_has("api: listening on 0.0.0.0 with api.open_reads: true")
        assert "level=warning" in line and "/v1/config" in line and "without a token" in line
    finally:
        assert d.stop() == 0


def test_loopback_gives_no_warning(tmp_path, wait):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nrecorder: {{path: {tmp_path}/f.sqlite}}\n"
                   "listen: {address: 127.0.0.1, port: 0}\napi: {open_reads: true}\n")
    d = GuardProcess(cfg, sim_root(tmp_path))
    try:
        d.find_base(wait)
        assert not d.log_has("api: listening on")
    finally:
        assert d.stop() == 0


def test_doctor_warns_about_open_reads_and_refuses_a_hostile_config(tmp_path):
    root = sim_root(tmp_path)
    cfg = tmp_path / "g.yaml"
    cfg.write_text("listen: {address: 0.0.0.0}\napi: {open_reads: true}\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    r = subprocess.run([sys.executable, "-m", "gpuguard", "doctor", "--sysfs-root", str(root), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode >= 1, r.stdout + r.stderr
    warn = [l for l in r.stdout.splitlines() if l.startswith("WARN") and " api " in l]
    assert len(warn) == 2 and "api.open_reads: true" in warn[0] and "0.0.0.0:9436" in warn[0], r.stdout
    cfg.write_bytes(b"gpus:\n  - name: \xff\n")
    r = subprocess.run([sys.executable, "-m", "gpuguard", "doctor", "--sysfs-root", str(root), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not UTF-8" in r.stderr, r.stderr
