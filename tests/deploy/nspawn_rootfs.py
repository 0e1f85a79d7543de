"""A minimal Debian bookworm root file system to boot gpuguard's units under a real
systemd (systemd-nspawn): systemd, python3-venv, pipx, and a venv at /opt/gpuguard that
already holds gpuguard's dependencies (from pyproject.toml; their wheels are kept in
/var/cache/gpuguard-wheels for pipx), so a test only installs gpuguard itself — the
README's documented paths — offline, and boots.

Built once with mmdebstrap (~100 s, needs the network) and kept under
/var/cache/gpuguard-test-rootfs/<key>/ where <key> hashes everything that goes into it;
a changed dependency list builds a new one. Tests never write into it: they boot an
overlay (tests/deploy/nspawn_machine.py). Run this module to build it ahead of the tests:
    python3 tests/deploy/nspawn_rootfs.py
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUGUARD_TEST_ROOTFS_CACHE", "/var/cache/gpuguard-test-rootfs"))
SUITE = "bookworm"
MIRROR = os.environ.get("GPUGUARD_TEST_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ["systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "pipx", "procps", "util-linux", "iproute2"]
FORMAT = 2  # bump when the recipe below changes


def python_deps() -> list[str]:
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # setuptools>=68: the build backend pyproject.toml asks for (bookworm's venv has 66)
    return sorted(proj["dependencies"]) + ["setuptools>=68", "wheel"]


def key() -> str:
    doc = json.dumps({"f": FORMAT, "suite": SUITE, "pkgs": PACKAGES, "py": python_deps()}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def missing_tools() -> str | None:
    """Why a rootfs cannot be built or booted here, or None."""
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, mmdebstrap)"
    tools = [("systemd-nspawn", "systemd-container"), ("nsenter", "util-linux")]
    if cached() is None:
        tools.append(("mmdebstrap", "mmdebstrap"))  # only to build the rootfs
    for tool, pkg in tools:
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian package: {pkg})"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "no overlayfs in this kernel (each test boots an overlay of the cached rootfs)"
    return None


def cached() -> Path | None:
    path = CACHE / key()
    return path if (path / ".complete").exists() else None


def build(log=sys.stderr) -> Path:
    """The cached rootfs, built first if needed (serialised by a lock: two test runs
    never build it twice)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    final = CACHE / key()
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():
            return final
        tmp = CACHE / f".build-{key()}"
        if tmp.exists():
            shutil.rmtree(tmp)  # a half-built tree of an interrupted run (our own scratch dir)
        deps = " ".join(f"'{d}'" for d in python_deps())
        # The wheels come from the build host's pip (its index, proxy and CA settings; the
        # chroot has none of them). Same Python minor (3.11) and glibc family as bookworm.
        wheels = CACHE / f".wheels-{key()}"
        shutil.rmtree(wheels, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), *python_deps()],
                       check=True, stdout=log, stderr=log, timeout=900)
        hooks = [
            # a venv at /opt/gpuguard with gpuguard's dependencies, from those wheels only
            f'chroot "$1" python3 -m venv /opt/gpuguard',
            f'mkdir "$1"/tmp/wheels && cp {wheels}/*.whl "$1"/tmp/wheels/',
            f'chroot "$1" /opt/gpuguard/bin/pip install -q --no-cache-dir --no-index --find-links /tmp/wheels {deps}',
            # kept for the offline pipx install (the README's other path)
            'mv "$1"/tmp/wheels "$1"/var/cache/gpuguard-wheels',
            # no getty/resolved noise; the machine id is made at first boot
            'rm -f "$1"/etc/machine-id; touch "$1"/etc/machine-id',
            'chroot "$1" systemctl mask console-getty.service getty@tty1.service systemd-networkd.service '
            'systemd-resolved.service apt-daily.timer apt-daily-upgrade.timer e2scrub_reap.service',
        ]
        cmd = ["mmdebstrap", "--variant=minbase", "--mode=root", f"--include={','.join(PACKAGES)}"]
        for h in hooks:
            cmd.append(f"--customize-hook={h}")
        cmd += [SUITE, str(tmp), MIRROR]
        subprocess.run(cmd, check=True, stdout=log, stderr=log, timeout=1200)
        shutil.rmtree(wheels, ignore_errors=True)
        (tmp / ".complete").write_text(json.dumps({"packages": PACKAGES, "python": python_deps()}) + "\n")
        os.replace(tmp, final)
        for old in CACHE.iterdir():
            # trees of earlier recipes (ours: they carry the marker) would only take disk
            if old != final and (old / ".complete").exists():
                shutil.rmtree(old, ignore_errors=True)
        return final


if __name__ == "__main__":
    why = missing_tools()
    if why:
        sys.exit(why)
    print(build())
