"""`gpuguard run` as a real subprocess against the FUSE-mounted simulated incident host:
profiles applied and read back before READY=1 (seen on a real NOTIFY_SOCKET), late cards,
drift after a GPU reset."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuguard.state.audit import profile_records
from gpuguard.sim.host import SimHost
from support import poll_until

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse, pytest.mark.network]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]
GPUS = {"r9700-a": "0000:05:00.0", "r9700-b": "0000:08:00.0", "xtx-a": "0000:aa:00.0", "xtx-b": "0000:b0:00.0"}
INTERVAL = 0.3


def write_config(tmp_path, mount, wait_for=4, extra=""):
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"""
sysfs_root: {mount}
state_dir: {tmp_path / 'state'}
recorder: {{enabled: false}}
listen: {{address: 127.0.0.1, port: 0}}
poll: {{interval_seconds: {INTERVAL}, discover_seconds: 0.5}}
profiles:
  psu-safe: {{power_cap_w: 210, sclk_offset_mhz: -500, vddgfx_offset_mv: -100}}
  xtx-2000: {{sclk_max_mhz: 2000, vddgfx_offset_mv: -100}}
apply: {{wait_for_gpus: {wait_for}, wait_timeout_seconds: 30, backoff_seconds: 0.05}}
gpus:
  - {{name: r9700-a, match: {{bdf: "0000:05:00.0"}}, profile: psu-safe}}
  - {{name: r9700-b, match: {{bdf: "0000:08:00.0"}}, profile: psu-safe}}
  - {{name: xtx-a, match: {{bdf: "0000:aa:00.0"}}, profile: xtx-2000}}
  - {{name: xtx-b, match: {{bdf: "0000:b0:00.0"}}, profile: xtx-2000}}
{extra}""")
    return cfg


class Daemon:
    def __init__(self, tmp_path, cfg):
        self.sock_path = str(tmp_path / f"notify-{len(list(tmp_path.glob('notify-*.sock')))}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.messages: list[str] = []
        env = {**os.environ, "NOTIFY_SOCKET": self.sock_path, "PYTHONPATH": str(REPO / "daemon")}
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "run", "--config", str(cfg)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_for(self, word, timeout=60.0, on_message=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg = self.sock.recv(65536).decode()
            except socket.timeout:
                break
            self.messages.append(msg)
            if on_message:
                on_message(msg)
            if word in msg.split("\n") or (word.startswith("STATUS=") and word in msg):
                return msg
            assert self.proc.poll() is None, self.output()
        raise AssertionError(f"no {word} within {timeout} s; got {self.messages}; output:\n{self.output()}")

    def output(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out.decode(errors="replace")

    def stop(self):
        out = self.output()
        self.sock.close()
        return out


def verified_gpus(state_dir):
    return {r["gpu"] for r in profile_records(os.path.join(state_dir, "audit.jsonl")) if r["action"] == "verified"}


def wait_until(cond, timeout, what):
    return poll_until(cond, timeout, what)


def test_run_applies_incident_profiles_before_ready(tmp_path, mount_sim):
    m = mount_sim()
    d = Daemon(tmp_path, write_config(tmp_path, m.mountpoint))
    seen_at_ready = {}

    def snapshot_at_ready(msg):
        if "READY=1" in msg.split("\n"):
            seen_at_ready["writes"] = m.writes_by_gpu()
            seen_at_ready["verified"] = verified_gpus(tmp_path / "state")

    try:
        d.wait_for("READY=1", on_message=snapshot_at_ready)
        # READY=1 came only after every card was written and read back equal
        assert seen_at_ready["verified"] == set(GPUS)
        w = seen_at_ready["writes"]
        for b in ("0000:05:00.0", "0000:08:00.0"):
            od = [x for x in w[b] if not x.startswith("control")]
            assert od == ["pp_od_clk_voltage: s -500", "pp_od_clk_voltage: vo -100", "pp_od_clk_voltage: c",
                          "power1_cap: 210000000"]
        for b in ("0000:aa:00.0", "0000:b0:00.0"):
            od = [x for x in w[b] if not x.startswith("control")]
            assert od == ["pp_od_clk_voltage: s 1 2000", "pp_od_clk_voltage: vo -100", "pp_od_clk_voltage: c"]
    finally:
        d.stop()
    # The load model: the limited cards draw less under full load than stock cards.
    stock = SimHost.incident()
    for h in (m.host, stock):
        for b in GPUS.values():
            h.set_load(b, 1.0)
        for _ in range(60):
            h.step(1.0)
    for b in GPUS.values():
        limited, free = m.host.state()["gpus"][b]["power_w"], stock.state()["gpus"][b]["power_w"]
        assert limited < free * 0.9, (b, limited, free)


@pytest.fixture
def late_host():
    host = SimHost.incident()
    host.add_late_gpu("0000:08:00.0")  # absent at boot; `appear()` is the sim's late-card path
    return host


def test_wait_for_gpus_applies_to_the_late_card_before_ready(tmp_path, mount_sim, late_host):
    m = mount_sim(late_host)
    assert "0000:08:00.0" not in m.host.gpus
    d = Daemon(tmp_path, write_config(tmp_path, m.mountpoint, wait_for=4))
    try:
        # the daemon is up and polling the three present cards, and waits: nothing written
        wait_until(lambda: m.recorder.reads.get("0000:05:00.0/pp_od_clk_voltage", 0) >= 1, 30, "first poll")
        wait_until(lambda: m.recorder.reads.get("0000:aa:00.0/uevent", 0) + m.recorder.reads.get("0000:aa:00.0/class", 0) >= 3,
                   30, "discovery rounds while waiting")
        assert m.recorder.writes == []
        assert not [x for x in d.messages if "READY=1" in x.split("\n")]
        m.host.appear("0000:08:00.0")  # INCIDENTS §2: the second card's node shows up late
        d.wait_for("READY=1")
        assert verified_gpus(tmp_path / "state") == set(GPUS)
        assert "pp_od_clk_voltage: c" in m.writes_by_gpu()["0000:08:00.0"]
    finally:
        d.stop()


def test_late_card_after_ready_is_applied_on_appearance(tmp_path, mount_sim, late_host):
    m = mount_sim(late_host)
    d = Daemon(tmp_path, write_config(tmp_path, m.mountpoint, wait_for=3))
    try:
        d.wait_for("READY=1")
        assert verified_gpus(tmp_path / "state") == set(GPUS) - {"r9700-b"}
        m.host.appear("0000:08:00.0")
        wait_until(lambda: "r9700-b" in verified_gpus(tmp_path / "state"), 30, "late card verified")
        rec = [r for r in profile_records(tmp_path / "state" / "audit.jsonl") if r["action"] == "verified" and r["gpu"] == "r9700-b"]
        assert "appeared" in rec[0]["why"]
    finally:
        d.stop()


def test_gpu_reset_drift_is_reapplied_within_two_cycles(tmp_path, mount_sim):
    m = mount_sim()
    d = Daemon(tmp_path, write_config(tmp_path, m.mountpoint))
    audit = tmp_path / "state" / "audit.jsonl"
    try:
        d.wait_for("READY=1")
        n = len(profile_records(audit))
        t_reset = time.time()
        m.host.reset_gpu("0000:aa:00.0")
        assert m.host.gpu("0000:aa:00.0").od.active["sclk_max"] == 2500  # stock again, silently
        rec = wait_until(lambda: [r for r in profile_records(audit)[n:] if r["action"] == "verified"], 30, "re-apply")
        assert rec[0]["gpu"] == "xtx-a" and rec[0]["why"].startswith("drift: sclk_max_mhz 2000→2500")
        first_write = next(r for r in profile_records(audit)[n:] if r["action"] == "write")
        # detected and re-applied within two poll cycles (plus the apply itself, and slack
        # for a small shared 2-core box, where such runs took 1.19 and 1.49 s)
        assert first_write["time"] - t_reset <= 2 * INTERVAL + 2.5
        assert m.host.gpu("0000:aa:00.0").od.active["sclk_max"] == 2000
    finally:
        d.stop()


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def test_safe_mode_after_two_host_crashes_following_apply(tmp_path, mount_sim):
    m = mount_sim(overlay={"/proc/cmdline": b"root=/dev/sda1 quiet\n", BOOT_ID: b"boot-1\n"})
    cfg = write_config(tmp_path, m.mountpoint)
    for boot in ("boot-2", "boot-3"):
        d = Daemon(tmp_path, cfg)
        d.wait_for("READY=1")
        d.proc.kill()  # the host "went down" right after the apply: no clean stop
        d.stop()
        m.fs.extra[BOOT_ID] = f"{boot}\n".encode()
    n = len(m.recorder.writes)
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_for("READY=1")
        d.wait_for("STATUS=4/4 GPUs up; profiles: SAFE MODE", timeout=10)
        assert len(m.recorder.writes) == n  # nothing applied
    finally:
        out = d.stop()
    assert "host went down within 300 s of applying profiles on 2 starts in a row" in out


def test_kernel_command_line_forces_safe_mode(tmp_path, mount_sim):
    m = mount_sim(overlay={"/proc/cmdline": b"root=/dev/sda1 gpuguard.safe quiet\n", BOOT_ID: b"boot-1\n"})
    d = Daemon(tmp_path, write_config(tmp_path, m.mountpoint))
    try:
        d.wait_for("READY=1")
        d.wait_for("STATUS=4/4 GPUs up; profiles: SAFE MODE", timeout=10)
        assert m.recorder.writes == []
    finally:
        out = d.stop()
    assert "kernel command line has 'gpuguard.safe'" in out


def test_unverified_gpu_is_named_in_status_and_alerted(tmp_path, mount_sim):
    m = mount_sim()
    cfg = write_config(tmp_path, m.mountpoint)
    cfg.write_text(cfg.read_text().replace("sclk_max_mhz: 2000", "sclk_max_mhz: 6000"))  # above OD_RANGE 5000
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_for("READY=1")  # the engines may start: the R9700s are verified; the XTXs are named
        d.wait_for("STATUS=4/4 GPUs up; profile unverified: xtx-a (refused), xtx-b (refused)", timeout=10)
        assert verified_gpus(tmp_path / "state") == {"r9700-a", "r9700-b"}
        assert not any(b in m.writes_by_gpu() for b in ("0000:aa:00.0", "0000:b0:00.0"))
    finally:
        out = d.stop()
    assert "profile_unverified" in out and "sclk_max_mhz=6000 MHz refused: outside the card's OD_RANGE 500…5000 MHz" in out


def test_drift_check_off_leaves_a_reset_card_alone(tmp_path, mount_sim):
    m = mount_sim()
    cfg = write_config(tmp_path, m.mountpoint)
    cfg.write_text(cfg.read_text().replace("backoff_seconds: 0.05}", "backoff_seconds: 0.05, drift_check: false}"))
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_for("READY=1")
        n = len(m.recorder.writes)
        m.host.reset_gpu("0000:aa:00.0")
        reads = m.recorder.reads.get("0000:aa:00.0/pp_od_clk_voltage", 0)
        wait_until(lambda: m.recorder.reads.get("0000:aa:00.0/pp_od_clk_voltage", 0) >= reads + 3, 10, "three more polls")
        assert len(m.recorder.writes) == n
    finally:
        d.stop()
