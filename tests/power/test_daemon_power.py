"""`gpuguard run` as a real process on the FUSE-mounted simulated §2 host (two R9700, the
simulator's clock running in real time): the fast-sampled peaks and the host PSU verdict
come out on /metrics, the headroom alert on /v1/events, and the flight recorder keeps the
peaks and the raw samples around the alert. The owner then applies the `psu-safe` profile
through the API (applied and read back by gpuguard): the peaks fall and the alert clears."""
from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.sim.control import send
from support import poll_until

pytestmark = [pytest.mark.slow, pytest.mark.fuse, pytest.mark.network]  # registered in pyproject.toml


R9700 = {"r9700-a": "0000:05:00.0", "r9700-b": "0000:08:00.0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sim(tmp_path):
    from gpuguard.sim.fuse import fuse_available

    reason = fuse_available()
    if reason:
        pytest.skip(f"FUSE not usable here ({reason}); CI runs this as root with fuse3 installed")
    mount, sock = tmp_path / "root", str(tmp_path / "sim.sock")
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.sim.fuse", str(mount), "--scenario", "amd-only-r9700",
                             "--step-interval", "0.05", "--control", sock],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    poll_until(lambda: (mount / "sys/bus/pci/devices").is_dir() and os.path.exists(sock), what="the FUSE sim")
    yield mount, (lambda op, **a: send(sock, op, **a))
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    subprocess.run(["fusermount3", "-u", "-z", str(mount)], capture_output=True)


def metrics(base: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=5).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_daemon_exports_peaks_alerts_on_the_psu_and_clears_after_the_offsets(sim, tmp_path):
    mount, ctl = sim
    for bdf in R9700.values():
        ctl("set_load", bdf=bdf, level=1.0)
    port = free_port()
    db = tmp_path / "state" / "flight.sqlite"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("ops: s3cret-token-0123456789\n")
    tokens.chmod(0o600)
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"""
sysfs_root: {mount}
state_dir: {tmp_path / 'state'}
recorder: {{path: {db}}}
listen: {{address: 127.0.0.1, port: {port}}}
kernel: {{enabled: false}}
api: {{token_file: {tokens}}}
profiles:
  psu-safe: {{power_cap_w: 210, sclk_offset_mhz: -500, vddgfx_offset_mv: -100}}
poll: {{interval_seconds: 1.0}}
gpus:
  - {{name: r9700-a, match: {{bdf: "0000:05:00.0"}}}}
  - {{name: r9700-b, match: {{bdf: "0000:08:00.0"}}}}
power: {{sample_hz: 20, psu_watts: 1300, other_watts: 450, margin_ratio: 0.25, clear_after_seconds: 3,
        cpu_budget_ratio: 0.5}}
""")
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def events(kind):
            return [e for e in httpx.get(f"{base}/v1/events", timeout=5).json() if e["kind"] == kind]

        def daemon_up():
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            return httpx.get(f"{base}/healthz", timeout=2).json()["ok"]

        poll_until(daemon_up, timeout=30, what="the daemon")
        alert = poll_until(lambda: events("power_headroom_low"), timeout=90, what="the PSU headroom alert")[0]
        assert alert["severity"] == "alert"
        assert "PSU headroom low" in httpx.get(f"{base}/v1/status", timeout=5).json()["summary"]
        doc = httpx.get(f"{base}/v1/power", timeout=5).json()
        assert doc["psu_watts"] == 1300 and doc["limit_watts"] == 975
        assert {g["gpu"] for g in doc["gpus"]} == set(R9700)
        assert all(g["source"] == "power1_average" for g in doc["gpus"])
        assert alert["fields"]["host_peak_watts"] >= 975 > alert["fields"]["host_mean_watts"]
        m = metrics(base)
        for gpu in R9700:
            peak = m[("gpuguard_gpu_power_peak_watts", (("gpu", gpu), ("source", "power1_average")))]
            p99 = m[("gpuguard_gpu_power_p99_watts", (("gpu", gpu), ("source", "power1_average")))]
            assert peak >= p99 > 100
            assert m[("gpuguard_power_sampler_hz", (("gpu", gpu),))] == 20
        poll_until(lambda: all(metrics(base)[("gpuguard_power_samples_total", (("gpu", g),))] >= 40 for g in R9700),
                   timeout=60, what="40 samples per GPU")
        assert m[("gpuguard_host_psu_watts", ())] == 1300
        assert m[("gpuguard_host_power_limit_watts", ())] == 975

        # the §2 fix: psu-safe on both cards, applied one at a time and read back
        for gpu in R9700:
            r = httpx.post(f"{base}/v1/gpus/{gpu}/apply", json={"profile": "psu-safe", "reason": "PSU headroom"},
                           headers={"Authorization": "Bearer s3cret-token-0123456789"}, timeout=60)
            assert r.status_code == 200, r.text
        for bdf in R9700.values():
            od = (mount / f"sys/bus/pci/devices/{bdf}/pp_od_clk_voltage").read_bytes().replace(b"\0", b"").decode()
            assert "OD_SCLK_OFFSET:\n-500Mhz" in od, od
        poll_until(lambda: events("power_headroom_ok"), timeout=90, what="the alert to clear")
        poll_until(lambda: metrics(base)[("gpuguard_host_power_headroom_alert", ())] == 0, timeout=30,
                   what="the alert gauge to drop")
        m = metrics(base)
        assert m[("gpuguard_host_power_peak_watts", ())] < 975
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    assert proc.returncode == 0, (tmp_path / "daemon.log").read_text()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM power_burst").fetchone()[0] >= 20
        hi, lo = c.execute("SELECT max(peak_w), min(peak_w) FROM power_windows WHERE samples > 0").fetchone()
        assert hi > 240 and lo < 190
        assert c.execute("SELECT count(*) FROM events WHERE kind = 'power_headroom_low'").fetchone()[0] == 1


def two_r9700(tmp_path, mount, port: int, interval: float, power: str):
    """The two R9700 of the simulated host, at `interval`, with `power` added to the sampler's settings."""
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"""
sysfs_root: {mount}
state_dir: {tmp_path / 'state'}
listen: {{address: 127.0.0.1, port: {port}}}
kernel: {{enabled: false}}
poll: {{interval_seconds: {interval}}}
gpus:
  - {{name: r9700-a, match: {{bdf: "0000:05:00.0"}}}}
  - {{name: r9700-b, match: {{bdf: "0000:08:00.0"}}}}
power: {{sample_hz: 20, {power}, cpu_budget_ratio: 0.5}}
""")
    return cfg


def test_an_idle_host_rests_the_sampler_and_load_brings_the_full_rate_back(sim, tmp_path):
    """Both cards idle (a few watts against a 300 W cap): after `rest_after_seconds` the
    sampler reads once a second (an idle host pays one wakeup a second for it,
    not 20) and says so on /metrics; a card put to work brings 20 Hz back within seconds
    and its windows fill with fast samples again."""
    mount, ctl = sim
    port = free_port()
    cfg = two_r9700(tmp_path, mount, port, interval=1.0, power="rest_after_seconds: 1")
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def rates() -> dict:
        assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
        m = metrics(base)
        return {g: m.get(("gpuguard_power_sampler_hz", (("gpu", g),))) for g in R9700}

    def window_samples() -> dict:
        return {g["gpu"]: g["samples"] for g in httpx.get(f"{base}/v1/power", timeout=5).json()["gpus"]}

    try:
        poll_until(lambda: httpx.get(f"{base}/healthz", timeout=2).json()["ok"], timeout=30, what="the daemon")
        poll_until(lambda: set(rates().values()) == {1.0}, timeout=30, what="the sampler at rest")
        at_rest = poll_until(lambda: (w := window_samples()) and set(w.values()) == {1} and w, timeout=10,
                             what="windows of one sample each")
        assert set(at_rest) == set(R9700)
        ctl("set_load", bdf=R9700["r9700-b"], level=1.0)
        poll_until(lambda: set(rates().values()) == {20.0}, timeout=30, what="the full rate back")
        poll_until(lambda: min(window_samples().values()) >= 10, timeout=30, what="full windows again")
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_psu_alert_clears_after_its_seconds_at_a_half_second_poll(sim, tmp_path):
    """`poll.interval_seconds: 0.5`: the headroom alert clears 5 s (the default
    power.clear_after_seconds) after the peaks fell under the clear line, not 5 intervals
    (2.5 s) after, which split one full-load run into three pages."""
    mount, ctl = sim
    for bdf in R9700.values():
        ctl("set_load", bdf=bdf, level=1.0)
    port = free_port()
    cfg = two_r9700(tmp_path, mount, port, interval=0.5, power="psu_watts: 1300, other_watts: 450, margin_ratio: 0.25")
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def events(kind):
        assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
        return [e for e in httpx.get(f"{base}/v1/events", timeout=5).json() if e["kind"] == kind]

    try:
        poll_until(lambda: events("power_headroom_low"), timeout=90, what="the PSU headroom alert")
        for bdf in R9700.values():
            ctl("set_load", bdf=bdf, level=0.0)
        ok = poll_until(lambda: events("power_headroom_ok"), timeout=60, what="the alert to clear")[0]
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    assert proc.returncode == 0, (tmp_path / "daemon.log").read_text()
    # every interval the daemon judged, from the flight recorder: (time, GPU peaks + other)
    with sqlite3.connect(tmp_path / "state" / "flight.sqlite") as c:
        intervals = c.execute("SELECT t, gpu_peak_sum_w + other_w FROM power_host WHERE gpu_peak_sum_w IS NOT NULL "
                              "ORDER BY t").fetchall()
    clear_line = 1300 * (1 - 0.25 - 0.05)
    over = [t for t, w in intervals if w >= clear_line and t < ok["time"]]
    assert over, intervals
    # from the last interval over the clear line to the all-clear: 5 s, and the interval that
    # crossed it (late by up to a second on a loaded machine)
    assert 5.0 <= ok["time"] - max(over) <= 5.0 + 0.5 + 1.0, (ok["time"], intervals)
