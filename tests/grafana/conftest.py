"""Fixtures for the shipped Grafana dashboard and Prometheus alert rules (grafana/)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
ALERTS = GRAFANA / "alerts.yml"
ALERTS_TEST = GRAFANA / "alerts_test.yml"
DASHBOARD = GRAFANA / "gpuguard-dashboard.json"


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; .ci/run installs it)")
    return path


@pytest.fixture(scope="session")
def run_promtool(promtool):
    """Run promtool with args; return (exit code, combined output) for the assertion message."""

    def run(*args: str, cwd: Path = GRAFANA) -> tuple[int, str]:
        p = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout + p.stderr

    return run


@pytest.fixture(scope="session")
def alert_rules() -> list[dict]:
    """Every rule of grafana/alerts.yml, each with its group's name under `group`."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [dict(rule, group=g["name"]) for g in doc["groups"] for rule in g["rules"]]


@pytest.fixture(scope="session")
def alert_tests() -> dict:
    """grafana/alerts_test.yml, the promtool unit tests of the rules."""
    return yaml.safe_load(ALERTS_TEST.read_text())


@pytest.fixture(scope="session")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="session")
def dashboard_exprs(dashboard) -> list[tuple[str, str]]:
    """(where, expr) for every query target of the dashboard."""
    return [
        (f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"])
        for p in dashboard["panels"]
        for t in p.get("targets", [])
    ]
