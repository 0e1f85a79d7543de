"""One config loader for everything (issue 14): `gpuguard doctor --config` reads the file
with the daemon's own loader, so it accepts every config `gpuguard config check` (the
daemon's loader) accepts — the shipped examples, and unquoted PCI addresses, which a YAML
1.1 reader turns into base-60 numbers — and rejects what it rejects, with the same words."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pcie.conftest import PciTree, incident_host

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]

UNQUOTED = {
    "unquoted-bdf.yaml": "gpus:\n  - name: xtx-0\n    match: {bdf: 0000:aa:00.0}\n    expect_link: {gen: 4, width: 16}\n",
    "unquoted-short.yaml": "gpus:\n  - name: xtx-1\n    match: {bdf: b0:00.0}\n    expect_link: {width: 16}\n",
    "unquoted-block.yaml": "gpus:\n  - name: r\n    match:\n      bdf: 0000:05:00.0\n    expect_link: {gen: 3}\n",
    "unquoted-pci-id.yaml": "gpus:\n  - name: x\n    match: {pci_id: 1002:744c, index: 1}\n    expect_link: {gen: 4}\n",
}
REJECTED = {
    "bad-bdf.yaml": "gpus:\n  - name: x\n    match: {bdf: 0000:zz:00.0}\n",
    "bad-key.yaml": "poll: {interval: 1}\n",
}


def gg(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"), NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return incident_host(PciTree(tmp_path_factory.mktemp("host") / "h")).base


def configs(tmp_path: Path) -> list[Path]:
    out = sorted((REPO / "config").glob("*.yaml"))
    for name, text in {**UNQUOTED, **REJECTED}.items():
        (tmp_path / name).write_text(text)
        out.append(tmp_path / name)
    return out


def test_doctor_accepts_every_config_the_daemon_accepts(tmp_path, host):
    seen = {"ok": 0, "rejected": 0}
    for cfg in configs(tmp_path):
        daemon = gg("config", "check", str(cfg))
        doctor = gg("doctor", "--sysfs-root", str(host), "--config", str(cfg))
        assert "Traceback" not in doctor.stderr, doctor.stderr
        if daemon.returncode == 0:
            seen["ok"] += 1
            assert "problem(s)" not in doctor.stderr, f"{cfg.name}: daemon accepts, doctor refuses:\n{doctor.stderr}"
            assert doctor.returncode in (0, 1, 2) and doctor.stdout.strip().splitlines()[-1].endswith("OK"), doctor.stdout
        else:
            seen["rejected"] += 1
            # Same loader, same words: every problem line of config check is in doctor's error.
            problems = [ln.strip() for ln in daemon.stderr.splitlines()[1:] if ln.strip()]
            assert problems and all(p in doctor.stderr for p in problems), (daemon.stderr, doctor.stderr)
            assert doctor.returncode == 2 and "OK" not in doctor.stdout
    assert seen == {"ok": len(configs(tmp_path)) - len(REJECTED), "rejected": len(REJECTED)}


def test_an_unquoted_address_reaches_the_expected_link_check(tmp_path, host):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(UNQUOTED["unquoted-bdf.yaml"])
    p = gg("doctor", "--sysfs-root", str(host), "--busy", "--config", str(cfg))
    line = next(ln for ln in p.stdout.splitlines() if "expect_link" in ln)
    assert line.startswith("FAIL") and "0000:aa:00.0" in line and "expected 16.0 GT/s x16" in line
