"""Fixtures for the deployment tests; helpers live in deploy_harness.py, nspawn_*.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deploy_harness import DaemonProcess  # noqa: E402
from gpuguard.sim.runner import build_scenario  # noqa: E402
from gpuguard.sim.tree import write_tree  # noqa: E402


@pytest.fixture
def sim_root(tmp_path) -> Path:
    root = tmp_path / "simhost"
    write_tree(build_scenario("amd-only-r9700"), str(root))
    return root


@pytest.fixture
def start_daemon():
    started: list[DaemonProcess] = []

    def start(root: Path, config: Path, env: dict | None = None) -> DaemonProcess:
        d = DaemonProcess(root, config, env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
