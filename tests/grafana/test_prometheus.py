"""A real Prometheus scrapes a sample of gpuguard's own /metrics text (rendered by MetricsSink from
a hand-built snapshot of the incident host) and evaluates grafana/alerts.yml: every rule loads
with health "ok", the alerts the snapshot calls for fire, and the others stay quiet."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gpuguard.sinks.metrics import MetricsSink
from gpuguard.state.hub import HostSnapshot, Hub
from gpuguard.state.snapshot import GpuSnapshot, OdState

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


ALERTS = Path(__file__).resolve().parents[2] / "grafana" / "alerts.yml"
DEADLINE_S = 60.0  # a deadline, not a wait: a loaded 2-core machine took over 20 s to start, scrape and evaluate


def _gpu(name: str, bdf: str, device_id: str, model: str, card: str, junction: float, power: float, cap: float,
         vram_total: int, vram_visible: int) -> GpuSnapshot:
    return GpuSnapshot(
        name=name, bdf=bdf, vendor="1002", device_id=device_id, driver="amdgpu", model=model, card=card,
        up=True, time=time.time(), runtime_status="active",
        power_watts=power, power_cap_watts=cap, power_cap_min_watts=210.0, power_cap_max_watts=cap,
        power_cap_default_watts=cap,
        temperatures={"edge": 60.0, "junction": junction, "mem": 70.0},
        temperature_limits={("edge", "crit"): 100.0, ("edge", "emergency"): 105.0,
                            ("junction", "crit"): 90.0, ("junction", "emergency"): 95.0,
                            ("mem", "crit"): 100.0, ("mem", "emergency"): 105.0},
        clocks_hz={"sclk": 2.0e9, "mclk": 1.249e9}, fan_rpm=799.0, busy_ratio=0.99,
        vram_used_bytes=20_000_000_000, vram_total_bytes=vram_total, vram_visible_bytes=vram_visible,
        voltages={"vddgfx": 0.9},
        od=OdState(format="rdna3", settings={"sclk_max_mhz": 2000, "vddgfx_offset_mv": -100}),
    )


@pytest.fixture
def exposition(tmp_path, monkeypatch) -> str:
    """gpuguard's /metrics text: xtx-0 past its junction emergency limit, one device_lost line
    counted, everything else healthy, from a gpuguard that started just now (its counts are
    new to the rules; a gpuguard up for longer than a rule's window whose count is already
    there at Prometheus's first scrape is not paged: grafana/alerts.yml's header). Written
    where the file server serves it."""
    import gpuguard.sinks.metrics as metrics_module

    # the test process imported the sink long ago in a whole-suite run
    monkeypatch.setattr(metrics_module, "STARTED", time.time())
    hub = Hub()
    hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=(
        _gpu("xtx-0", "0000:aa:00.0", "744c", "Radeon RX 7900 XTX", "card2", 96.0, 272.0, 355.0,
             25_753_026_560, 25_753_026_560),
        _gpu("r9700-0", "0000:05:00.0", "7551", "Radeon AI PRO R9700", "card0", 77.0, 182.0, 300.0,
             34_208_743_424, 34_208_743_424),
    )))
    hub.gpus.kernel_counts[("xtx-0", "device_lost")] += 1
    hub.counters.poll_duration.labels(source="gpu").observe(0.004)
    text = MetricsSink(hub).render().decode()
    started = next(float(l.split()[1]) for l in text.splitlines() if l.startswith("gpuguard_start_time_seconds "))
    assert time.time() - started < 60, "the exposition's start time is not now (a cached build block?)"
    (tmp_path / "metrics.txt").write_text(text)
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _until(what: str, check, proc: subprocess.Popen, deadline: float):
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode} while waiting for {what} (see prometheus.log)")
        try:
            last = check()
        except (httpx.HTTPError, ValueError) as e:  # ValueError: "Service Unavailable" text before ready
            last = e
        else:
            if last is not None and last is not False:
                return last
        time.sleep(0.2)  # polling interval of a condition with a deadline, not a wait for it
    pytest.fail(f"no {what} within {DEADLINE_S} s; last answer: {last!r}")


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus not installed (Debian package `prometheus`; .ci/run installs it)")
def test_real_prometheus_loads_rules_and_fires_on_gpuguard_exposition(tmp_path, exposition):
    assert 'gpuguard_kernel_events_total{gpu="xtx-0",kind="device_lost"} 1.0' in exposition
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    prom = api = None
    log = open(tmp_path / "prometheus.log", "w")
    try:
        line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 41234 (...)"
        metrics_port = int(line.split(" port ")[1].split()[0])
        port = _free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "gpuguard", "metrics_path": "/metrics.txt",
                                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen(
            [shutil.which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log, cwd=tmp_path,
        )
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=2.0)
        deadline = time.monotonic() + DEADLINE_S

        def evaluated_rules():
            groups = api.get("/rules").json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules):
                return rules
            return None

        # Evaluated once with data scraped: wait for the scrape to be in first.
        _until("scraped sample", lambda: api.get("/query", params={
            "query": 'gpuguard_gpu_temperature_celsius{gpu="xtx-0",sensor="junction"}'}).json()["data"]["result"],
            prom, deadline)
        rules = _until("evaluated rules", evaluated_rules, prom, deadline)
        expected = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
        assert {r["name"] for r in rules} == expected
        bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
        assert bad == {}

        def firing():
            alerts = api.get("/alerts").json()["data"]["alerts"]
            names = {(a["labels"]["alertname"], a["labels"].get("gpu")) for a in alerts if a["state"] == "firing"}
            return names if {("GpuguardTemperatureEmergency", "xtx-0"), ("GpuguardGpuDeviceLost", "xtx-0")} <= names \
                else None

        names = _until("firing alerts", firing, prom, deadline)
        # Only those two fire: r9700-0 is 18 °C under its limit, both GPUs are up, the poll is fresh.
        # (A Prometheus with no history sees the existing device_lost counter as new: documented.)
        assert names == {("GpuguardTemperatureEmergency", "xtx-0"), ("GpuguardGpuDeviceLost", "xtx-0")}
    finally:
        if api is not None:
            api.close()
        if prom is not None:
            _stop(prom)
        _stop(server)
        server.stdout.close()
        log.close()
