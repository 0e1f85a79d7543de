"""`gpuguard install-service` into a temporary root: every file it writes, with its
content and mode; idempotent (a second run keeps the config and the token); --dry-run
changes nothing; uninstall-service removes only what install-service wrote."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_harness import REPO
from gpuguard.config import load_config
from gpuguard.install.service import MARK
from gpuguard.control.auth import TokenStore

pytestmark = [pytest.mark.slow, pytest.mark.root]  # registered in pyproject.toml


EXE = "/opt/gpuguard/bin/gpuguard"
SYSTEMCTL = shutil.which("systemctl")


def gpuguard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "daemon")))


def tree(root: Path) -> dict[str, tuple[int, bytes | str]]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        body = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else b"")
        out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), body)
    return out


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_install_writes_every_file_with_its_content_and_mode(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    r = gpuguard("install-service", "--root", str(root), "--exec", EXE)
    assert r.returncode == 0, r.stderr

    unit = root / "etc/systemd/system/gpuguard.service"
    assert mode(unit) == 0o644
    shipped = (REPO / "units/gpuguard.service").read_text()
    text = unit.read_text()
    assert text.splitlines()[0] == MARK
    # exactly the shipped unit, with both commands pointing at the gpuguard given
    expected = MARK + "\n" + shipped.replace("/opt/gpuguard/bin/gpuguard", EXE)
    assert text == expected
    assert f"\nExecStart={EXE} run --config /etc/gpuguard/gpuguard.yaml\n" in text
    assert f"\nExecReload={EXE} reload --pid $MAINPID\n" in text

    etc = root / "etc/gpuguard"
    assert etc.is_dir() and mode(etc) == 0o755
    cfg = etc / "gpuguard.yaml"
    assert mode(cfg) == 0o600  # webhook URLs carry secrets
    example = (REPO / "config/gpuguard.yaml").read_text()
    diff = [(a, b) for a, b in zip(example.splitlines(), cfg.read_text().splitlines()) if a != b]
    assert len(example.splitlines()) == len(cfg.read_text().splitlines())
    assert [b for _, b in diff] == ["  token_file: /etc/gpuguard/api-tokens"]
    assert load_config(cfg).api.token_file == "/etc/gpuguard/api-tokens"  # the file is valid as written

    tokens = etc / "api-tokens"
    assert mode(tokens) == 0o600 and tokens.stat().st_uid == os.geteuid()
    store = TokenStore.load(str(tokens))  # the daemon's own loader accepts it (it refuses 0644)
    assert store.names == ["admin"]
    assert re.search(r"^admin: [0-9a-f]{64}$", tokens.read_text(), re.M)

    link = root / "usr/local/bin/gpuguard"
    assert link.is_symlink() and os.readlink(link) == EXE

    if SYSTEMCTL:
        wants = root / "etc/systemd/system/multi-user.target.wants/gpuguard.service"
        assert wants.is_symlink() and os.readlink(wants) == "/etc/systemd/system/gpuguard.service"
        expected_files = 5
    else:
        assert "systemctl not found" in r.stderr
        expected_files = 4
    assert len([p for p in root.rglob("*") if p.is_file() or p.is_symlink()]) == expected_files


def test_second_install_keeps_config_and_token_and_dry_run_changes_nothing(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    assert gpuguard("install-service", "--root", str(root), "--exec", EXE).returncode == 0
    cfg = root / "etc/gpuguard/gpuguard.yaml"
    cfg.write_text(cfg.read_text() + "# edited by the operator\n")
    before = tree(root)

    r = gpuguard("install-service", "--root", str(root), "--exec", EXE, "--dry-run")
    assert r.returncode == 0 and tree(root) == before
    assert r.stdout.splitlines()[:3] == [
        f"would keep {root}/etc/systemd/system/gpuguard.service: unchanged",
        f"would keep {root}/etc/gpuguard/gpuguard.yaml: exists (never overwritten; `gpuguard config check` it)",
        f"would keep {root}/etc/gpuguard/api-tokens: exists (never overwritten)",
    ]

    r = gpuguard("install-service", "--root", str(root), "--exec", EXE)
    assert r.returncode == 0, r.stderr
    assert tree(root) == before  # same token, the operator's edit kept, the unit unchanged

    # a different gpuguard path rewrites the unit only
    r = gpuguard("install-service", "--root", str(root), "--exec", "/opt/other/bin/gpuguard")
    assert r.returncode == 0
    after = tree(root)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {"etc/systemd/system/gpuguard.service"}


def test_dry_run_on_a_fresh_root_lists_the_steps_and_writes_nothing(tmp_path):
    r = gpuguard("install-service", "--root", str(tmp_path), "--exec", EXE, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []
    assert r.stdout.splitlines() == [
        f"would write {tmp_path}/etc/systemd/system/gpuguard.service (mode 0644): the unit, "
        f"ExecStart={EXE} run --config /etc/gpuguard/gpuguard.yaml",
        f"would create directory {tmp_path}/etc/gpuguard (mode 0755)",
        f"would write {tmp_path}/etc/gpuguard/gpuguard.yaml (mode 0600): the annotated example, "
        "api.token_file: /etc/gpuguard/api-tokens",
        f"would write {tmp_path}/etc/gpuguard/api-tokens (mode 0600): one new random token named admin",
        f"would link {tmp_path}/usr/local/bin/gpuguard -> {EXE}",
        f"would run: systemctl --root={tmp_path} enable gpuguard.service",
    ]


@pytest.mark.skipif(SYSTEMCTL is None, reason="systemctl not installed (Debian package: systemd)")
def test_uninstall_removes_what_install_wrote_and_keeps_config(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    assert gpuguard("install-service", "--root", str(root), "--exec", EXE).returncode == 0
    (root / "var/lib/gpuguard").mkdir(parents=True)
    (root / "var/lib/gpuguard/audit.jsonl").write_text("{}\n")
    r = gpuguard("uninstall-service", "--root", str(root))
    assert r.returncode == 0, r.stderr
    left = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}
    assert left == {"etc/gpuguard/gpuguard.yaml", "etc/gpuguard/api-tokens", "var/lib/gpuguard/audit.jsonl",
                    "usr/local/bin/gpuguard"}  # the link may be pipx's: it goes with the venv
    assert "keep" in r.stdout and "config, tokens and state are kept" in r.stdout

    # a unit the operator wrote by hand (no marker) is disabled but never removed
    assert gpuguard("install-service", "--root", str(root), "--exec", EXE).returncode == 0
    unit = root / "etc/systemd/system/gpuguard.service"
    unit.write_text(unit.read_text().replace(MARK + "\n", ""))
    r = gpuguard("uninstall-service", "--root", str(root))
    assert r.returncode == 0 and unit.exists() and "not written by install-service" in r.stdout


def test_install_refuses_a_path_with_spaces_and_names_it(tmp_path):
    r = gpuguard("install-service", "--root", str(tmp_path), "--exec", "/opt/my env/bin/gpuguard")
    assert r.returncode == 1 and "'/opt/my env/bin/gpuguard' contains white space" in r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def test_install_refuses_a_gpuguard_under_tmp_the_unit_cannot_see(tmp_path):
    """The unit runs with PrivateTmp=yes: a venv under /tmp (or /var/tmp) is not there
    for the service, which could never start."""
    for exe in ("/tmp/venv/bin/gpuguard", "/var/tmp/gv/bin/gpuguard"):
        r = gpuguard("install-service", "--root", str(tmp_path), "--exec", exe)
        assert r.returncode == 1, r.stdout
        assert f"ExecStart={exe}" in r.stderr and "PrivateTmp=yes" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def test_install_refuses_now_below_another_root(tmp_path):
    """--now starts the service on this host; below --root nothing is started: said, not ignored."""
    r = gpuguard("install-service", "--root", str(tmp_path), "--exec", EXE, "--now")
    assert r.returncode == 1 and "--now" in r.stderr and "--root" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_install_under_umask_000_creates_folders_0755(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    r = subprocess.run([sys.executable, "-m", "gpuguard", "install-service", "--root", str(root), "--exec", EXE],
                       capture_output=True, text=True, timeout=120, umask=0,
                       env=dict(os.environ, PYTHONPATH=str(REPO / "daemon")))
    assert r.returncode == 0, r.stderr
    for d in ("etc", "etc/systemd", "etc/systemd/system", "etc/gpuguard", "usr", "usr/local", "usr/local/bin"):
        assert mode(root / d) == 0o755, d
    assert mode(root / "etc/gpuguard/api-tokens") == 0o600 and mode(root / "etc/gpuguard/gpuguard.yaml") == 0o600


def test_an_existing_token_file_others_can_read_is_made_0600_and_said(tmp_path):
    """The daemon refuses a token file others can read: a re-install that kept a 0644 one
    left a service that would not start."""
    root = tmp_path / "root"
    tokens = root / "etc/gpuguard/api-tokens"
    tokens.parent.mkdir(parents=True)
    body = "admin: " + "ab" * 32 + "\n"
    tokens.write_text(body)
    tokens.chmod(0o644)
    r = gpuguard("install-service", "--root", str(root), "--exec", EXE)
    assert r.returncode == 0, r.stderr
    assert mode(tokens) == 0o600 and tokens.read_text() == body  # the tokens kept, only the mode fixed
    assert f"fix mode of {tokens}: 0644 -> 0600" in r.stdout, r.stdout
    TokenStore.load(str(tokens))  # the daemon's own check accepts it now


def test_a_token_file_that_is_a_link_is_refused_not_followed(tmp_path):
    root = tmp_path / "root"
    (root / "etc/gpuguard").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not a token file\n")
    elsewhere.chmod(0o644)
    (root / "etc/gpuguard/api-tokens").symlink_to(elsewhere)
    r = gpuguard("install-service", "--root", str(root), "--exec", EXE)
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
    assert mode(elsewhere) == 0o644  # nothing changed through the link
