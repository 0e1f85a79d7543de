"""Boot a throw-away machine under a real systemd: systemd-nspawn on an overlay of the
cached rootfs (tests/deploy/nspawn_rootfs.py), so every test starts from the same clean tree and
the cache is never written. Commands run inside with nsenter (no machined is needed:
--register=no).

The flags are the ones these machines need (issue 19): a host without systemd as PID 1
and a hybrid cgroup tree wants --register=no --keep-unit and the unified hierarchy;
CAP_SYSLOG and /dev/kmsg so the daemon can read the kernel log; the bpf() system call so
systemd can enforce DevicePolicy= (without it the device policy is silently not applied).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
from support import poll_until


class Machine:
    def __init__(self, rootfs: Path, work: Path, log: Path) -> None:
        self.name = f"gpuguard-test-{uuid.uuid4().hex[:8]}"
        self.work = work
        self.root = work / "merged"
        for d in ("upper", "ovl-work", "merged"):
            (work / d).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={rootfs},upperdir={work / 'upper'},workdir={work / 'ovl-work'}", str(self.root)],
                       check=True, timeout=30)
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--quiet", "-D", str(self.root), f"--machine={self.name}", "--boot",
             "--register=no", "--keep-unit", "--capability=CAP_SYSLOG", "--system-call-filter=bpf",
             "--bind-ro=/dev/kmsg", "--resolv-conf=off", "--timezone=off", "--link-journal=no"],
            env=dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1"),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.leader = 0
        try:
            self.leader = poll_until(self._find_leader, timeout=60, what="the container's init")
            poll_until(lambda: self.sh("systemctl is-system-running", check=False).stdout.strip() in ("running", "degraded"),
                       timeout=120, what="the container's boot to finish", interval=0.2)
        except BaseException:
            self.close()
            raise

    def _find_leader(self) -> int:
        if self.proc.poll() is not None:
            raise AssertionError("systemd-nspawn exited:\n" + self.log_path.read_text()[-3000:])
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                # the container's PID 1 (a `systemd --user` only appears after boot)
                if child.name() == "systemd" and "--user" not in child.cmdline():
                    return child.pid
            except psutil.Error:
                continue
        return 0

    def sh(self, script: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a shell script inside the machine (all its namespaces, its root)."""
        r = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "-C", "-r", "-w",
             "/usr/bin/env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "LANG=C.UTF-8", "SYSTEMD_PAGER=", "/bin/sh", "-c", script],
            capture_output=True, text=True, timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"in the machine, `{script}` exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def close(self) -> None:
        if self.proc.poll() is None:
            # nspawn turns SIGTERM into an orderly poweroff of the machine
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        for _ in range(50):
            r = subprocess.run(["umount", str(self.root)], capture_output=True, timeout=30)
            if r.returncode == 0 or not os.path.ismount(self.root):
                break
            time.sleep(0.1)  # the last container processes are still leaving the mount
        if not os.path.ismount(self.root):
            shutil.rmtree(self.work, ignore_errors=True)
