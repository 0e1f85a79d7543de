"""The fleet alert path for real, on loopback: two gpuguard daemons on two simulated
hosts, each watching a simulated vLLM, scraped by one Prometheus that loads
grafana/alerts.yml through deploy/prometheus/prometheus.yml and sends to an Alertmanager
running deploy/alertmanager/alertmanager.yml. A stall of host A's engine arrives at the
Alertmanager webhook receiver as GpuguardEngineStalled, labelled with host A's instance,
routed to the on-call receiver — and nothing about host B. A global Prometheus federating
the site (deploy/prometheus/federation.yml) sees the series and the alert, site-labelled.

Only the examples' addresses, paths and timers are changed for the test (scrape and
evaluation every second, group_wait 1 s); labels, rules and routes are the shipped ones."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from support import poll_until

from deploy_harness import REPO
from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = [
    pytest.mark.slow, pytest.mark.network,  # registered in pyproject.toml
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs prometheus and alertmanager (Debian packages: prometheus, prometheus-alertmanager)",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AlertReceiver:
    """Alertmanager's webhook receiver: every POSTed notification, as JSON."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/alertmanager"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def alerts(self, name: str) -> list[tuple[str, dict]]:
        return [(n["receiver"], a) for n in self.got for a in n["alerts"]
                if a["labels"].get("alertname") == name and a["status"] == "firing"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Proc:
    def __init__(self, argv: list[str], log: Path, **kw) -> None:
        self.log = log
        self._f = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, **kw)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        self._f.close()


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def host(tmp_path: Path, name: str, token: str, start_daemon, procs) -> dict:
    """One simulated GPU host: sysfs tree, a simulated vLLM, gpuguard watching it."""
    d = tmp_path / name
    root = d / "root"
    write_tree(build_scenario("amd-only-r9700"), str(root))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    engine = Proc([sys.executable, "-m", "gpuguard.sim.engines", "--kind", "vllm", "--port", str(port),
                   "--pid-file", str(d / "engine.pid")], d / "engine.log", env=env)
    procs.append(engine)
    url = f"http://127.0.0.1:{port}"
    poll_until(lambda: httpx.get(url + "/health", timeout=1).status_code == 200, timeout=30, what=f"host {name}'s engine")
    tokens = d / "api-tokens"
    tokens.write_text(f"prometheus: {token}\n")
    tokens.chmod(0o600)
    cfg = d / "gpuguard.yaml"
    cfg.write_text(yaml.safe_dump({
        "state_dir": str(d / "state"), "recorder": {"path": str(d / "state/flight.sqlite")},
        "listen": {"address": "127.0.0.1", "port": 0}, "api": {"token_file": str(tokens)},
        "kernel": {"enabled": False}, "poll": {"interval_seconds": 0.5},
        "engines": [{"name": "llm", "kind": "vllm", "url": url, "process": {"pid_file": str(d / "engine.pid")},
                     "stall_after": 2, "poll_interval": 0.5, "http_timeout": 1, "action": "alert"}],
    }))
    daemon = start_daemon(root, cfg)
    httpx.post(url + "/sim/requests", json={"count": 2}, timeout=5).raise_for_status()  # busy, never finishing
    return {"engine_url": url, "instance": daemon.base.removeprefix("http://"), "daemon": daemon}


def test_a_stall_on_one_host_reaches_alertmanager_labelled_with_its_instance(tmp_path, start_daemon, procs):
    receiver = AlertReceiver()
    try:
        token = secrets.token_hex(32)
        a = host(tmp_path, "a", token, start_daemon, procs)
        b = host(tmp_path, "b", token, start_daemon, procs)

        am_port = free_port()
        am_cfg = yaml.safe_load((REPO / "deploy/alertmanager/alertmanager.yml").read_text())
        for r in am_cfg["receivers"]:
            for w in r.get("webhook_configs", []):
                w["url"] = receiver.url
        for route in [am_cfg["route"], *am_cfg["route"]["routes"]]:
            route.update({k: "1s" for k in ("group_wait", "group_interval") if k in route or route is am_cfg["route"]})
        (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(am_cfg))
        procs.append(Proc([ALERTMANAGER, f"--config.file={tmp_path / 'alertmanager.yml'}",
                           f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                           "--cluster.listen-address="], tmp_path / "alertmanager.log"))

        prom_port = free_port()
        prom = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
        prom["global"].update(scrape_interval="1s", evaluation_interval="1s")
        prom["rule_files"] = [str(REPO / "grafana/alerts.yml")]
        prom["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{am_port}"]}]
        (job,) = prom["scrape_configs"]
        (tmp_path / "prom-token").write_text(token)
        job["authorization"]["credentials_file"] = str(tmp_path / "prom-token")
        (tmp_path / "targets").mkdir()
        job["file_sd_configs"][0]["files"] = [str(tmp_path / "targets/*.yml")]
        (tmp_path / "targets/hosts.yml").write_text(yaml.safe_dump([{"targets": [a["instance"], b["instance"]]}]))
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
        procs.append(Proc([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                           f"--storage.tsdb.path={tmp_path / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                          tmp_path / "prometheus.log"))
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def up() -> dict[str, str]:
            r = httpx.get(f"{api}/query", params={"query": 'up{job="gpuguard"}'}, timeout=5).json()
            return {s["metric"]["instance"]: s["value"][1] for s in r["data"]["result"]}

        poll_until(lambda: up() == {a["instance"]: "1", b["instance"]: "1"}, timeout=60,
                   what="Prometheus scraping both hosts (with the token)", interval=0.2)
        poll_until(lambda: httpx.get(f"http://127.0.0.1:{am_port}/-/ready", timeout=2).status_code == 200,
                   timeout=30, what="Alertmanager ready")
        assert not receiver.alerts("GpuguardEngineStalled")

        t = time.monotonic()
        httpx.post(a["engine_url"] + "/sim/stall", timeout=5).raise_for_status()
        hits = poll_until(lambda: receiver.alerts("GpuguardEngineStalled"), timeout=90, interval=0.2,
                          what="GpuguardEngineStalled at the Alertmanager webhook")
        elapsed = time.monotonic() - t
        rcv, alert = hits[0]
        assert alert["labels"]["instance"] == a["instance"] and alert["labels"]["engine"] == "llm"
        assert alert["labels"]["severity"] == "critical" and rcv == "gpuguard-oncall"
        assert a["instance"] in alert["annotations"]["summary"]
        assert all(al["labels"]["instance"] == a["instance"] for _, al in receiver.alerts("GpuguardEngineStalled"))
        # host B's engine kept working: its stall gauge is 0 in Prometheus
        r = httpx.get(f"{api}/query", params={"query": "gpuguard_engine_stalled"}, timeout=5).json()
        stalled = {s["metric"]["instance"]: s["value"][1] for s in r["data"]["result"]}
        assert stalled == {a["instance"]: "1", b["instance"]: "0"}
        print(f"\nstall -> Alertmanager webhook: {elapsed:.1f} s")

        # a global Prometheus federating this site (deploy/prometheus/federation.yml) sees
        # the series and the firing alert, with the site's label
        glob_port = free_port()
        fed = yaml.safe_load((REPO / "deploy/prometheus/federation.yml").read_text())
        fed["global"]["scrape_interval"] = "1s"
        fed["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{prom_port}"]}]
        (tmp_path / "federation.yml").write_text(yaml.safe_dump(fed))
        procs.append(Proc([PROMETHEUS, f"--config.file={tmp_path / 'federation.yml'}",
                           f"--storage.tsdb.path={tmp_path / 'global-data'}", f"--web.listen-address=127.0.0.1:{glob_port}"],
                          tmp_path / "global.log"))

        def global_query(q: str) -> list[dict]:
            r = httpx.get(f"http://127.0.0.1:{glob_port}/api/v1/query", params={"query": q}, timeout=5).json()
            return [x["metric"] for x in r["data"]["result"]]

        firing = poll_until(lambda: global_query('ALERTS{alertname="GpuguardEngineStalled",alertstate="firing"}'),
                            timeout=60, interval=0.2, what="the federated alert")
        assert [(m["instance"], m["site"]) for m in firing] == [(a["instance"], "site-a")]
        assert {m["instance"] for m in global_query('gpuguard_engine_stalled{site="site-a"}')} == {a["instance"], b["instance"]}
    finally:
        receiver.close()
