"""A real alerting chain for end-to-end tests of grafana/alerts.yml: the simulated host (FUSE),
gpuguard as a process reading it, Prometheus (Debian `prometheus`) scraping gpuguard and
evaluating a test copy of the rules, Alertmanager (Debian `prometheus-alertmanager`) routing
with the shipped inhibitions to a webhook receiver.

The test copy of the rules is rendered from the shipped file: only the `for:` durations are
scaled (1 minute -> 3 seconds, at least 1 s), so the same expressions and labels are tested;
a test of what happens after a rule's window has passed scales the windows inside the
expressions too (`render_rules(window_scale=...)`), nothing else.
Scrapes run every 2 s: a loaded CI machine can miss a 1 s scrape deadline, and one or two
missed scrapes must not page (GpuguardDown waits 6 s, GpuguardAbsent 15 s in the test copy)."""
from __future__ import annotations

import os
import re
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

from support import poll_until

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "grafana" / "alerts.yml"
AM_EXAMPLE = REPO / "grafana" / "alertmanager.example.yml"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds(d: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", d)
    assert parts and "".join(n + u for n, u in parts) == d, f"unparsed duration {d!r}"
    return sum(int(n) * units[u] for n, u in parts)


# Floors of the scaled `for:` (s): a scrape that times out on a loaded machine is not gpuguard down.
FOR_FLOOR = {"GpuguardDown": 6}
# Thresholds in seconds inside an expression, scaled like the `for:` durations: (alert, the
# text as shipped, its seconds, the floor). GpuguardNotPolling's 60 s of poll silence: at
# 1/20 that is 3 s, but a sample scraped every 2 s is up to ~2 s old when evaluated and a
# late scrape on a loaded machine adds more, so at least 10 s (5 scrape intervals).
EXPR_SECONDS = [("GpuguardNotPolling", "> 60", 60, 10)]


# A range or offset inside an expression: `[10m]`, `[5m:]`, `offset 10m`, and a window in
# seconds against the clock: `time() - 600`.
_WINDOW = re.compile(r"\[(\d+(?:ms|s|m|h|d))(:[^\]]*)?\]|(offset) (\d+(?:ms|s|m|h|d))|(time\(\) - )(\d+)\b")
# Floor of a scaled window (s): a window holds at least 4 scrapes of 2 s.
WINDOW_FLOOR = 8


def scale_windows(expr: str, scale: float) -> str:
    """`expr` with every range and offset duration scaled (at least WINDOW_FLOOR s), the same
    factor for all, so `x[w]` and `x offset w` stay one window."""
    def one(m: re.Match) -> str:
        if m.group(5):
            return f"time() - {max(WINDOW_FLOOR, round(int(m.group(6)) * scale))}"
        d = m.group(1) or m.group(4)
        short = f"{max(WINDOW_FLOOR, round(seconds(d) * scale))}s"
        return f"offset {short}" if m.group(3) else f"[{short}{m.group(2) or ''}]"

    return _WINDOW.sub(one, expr)


def render_rules(dest: Path, scale: float = 1 / 20, window_scale: float | None = None) -> dict[str, float]:
    """Write alerts.yml with every non-zero `for:` scaled (at least 1 s); return alert -> for (s).
    With `window_scale`, the ranges and offsets of the expressions are scaled too (a test of
    what happens after a rule's window has passed); the expressions are otherwise as shipped."""
    doc = yaml.safe_load(ALERTS.read_text())
    fors = {}
    for g in doc["groups"]:
        for r in g["rules"]:
            if window_scale is not None:
                r["expr"] = scale_windows(r["expr"], window_scale)
            for alert, text, secs, floor in EXPR_SECONDS:
                if r["alert"] == alert:
                    assert text in r["expr"], f"{alert}: expected {text!r} in its expression to scale"
                    r["expr"] = r["expr"].replace(text, f"> {max(floor, round(secs * scale))}")
            f = seconds(r["for"])
            short = 0 if f == 0 else max(1, FOR_FLOOR.get(r["alert"], 1), round(f * scale))
            r["for"] = f"{short}s"
            fors[r["alert"]] = short
    dest.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return fors


class Proc:
    """A child process with its log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], log: Path, **kw) -> None:
        self.name, self.log_path = name, log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, **kw)

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
        return True

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Sim(Proc):
    def __init__(self, tmp: Path, scenario: str = "incident", step_interval: float = 0, kmsg: bool = False) -> None:
        try:
            from gpuguard.sim.fuse import fuse_available
        except (ImportError, OSError) as e:  # no mfusepy, or no libfuse (FUSE_LIBRARY_NAME=none)
            pytest.skip(f"FUSE not usable here ({e}); CI runs this as root with fuse3 installed")
        reason = fuse_available()
        if reason:
            pytest.skip(f"FUSE not usable here ({reason}); CI runs this as root with fuse3 installed")
        self.mount, self.sock = tmp / "root", str(tmp / "sim.sock")
        # The simulated kernel log as kernel records (sim/kmsg_pipe.py): kernel.kmsg_path of
        # the daemon, never the machine's own /dev/kmsg.
        self.kmsg_fifo = tmp / "kmsg.fifo" if kmsg else None
        super().__init__("sim", [sys.executable, "-m", "gpuguard.sim.fuse", str(self.mount), "--scenario", scenario,
                                 "--step-interval", str(step_interval), "--control", self.sock,
                                 *(["--kmsg", str(self.kmsg_fifo)] if kmsg else [])], tmp / "sim.log")
        poll_until(lambda: self.alive() and (self.mount / "sys/bus/pci/devices").is_dir() and os.path.exists(self.sock)
                   and (not kmsg or self.kmsg_fifo.exists()), 30, "the FUSE sim to mount")

    def ctl(self, op: str, **args):
        from gpuguard.sim.control import send

        return send(self.sock, op, **args)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        super().stop(sig)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)


class Gpuguard(Proc):
    def __init__(self, tmp: Path, sysfs_root: Path, config_text: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "gpuguard.yaml"
        cfg.write_text(config_text + f"\nlisten: {{address: 127.0.0.1, port: {self.port}}}\nstate_dir: {tmp / 'state'}\n"
                       f"recorder: {{path: {tmp / 'state' / 'flight.sqlite'}}}\n")
        super().__init__("gpuguard", [sys.executable, "-m", "gpuguard", "run", "--config", str(cfg),
                                      "--sysfs-root", str(sysfs_root)], tmp / "gpuguard.log",
                         env={**os.environ, "PYTHONPATH": str(REPO / "daemon")})
        poll_until(self.healthy, 60, f"gpuguard on {self.base} (log {self.log_path})")

    def healthy(self) -> bool:
        self.alive()
        try:
            return httpx.get(f"{self.base}/healthz", timeout=2).json()["ok"]
        except httpx.HTTPError:
            return False

    def metric(self, line_start: str) -> float | None:
        for line in httpx.get(f"{self.base}/metrics", timeout=5).text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return None


class NvmlHost(Gpuguard):
    """`gpuguard run` on the recorded H200 (gpuguard.sim.nvml_host): its NVML answers as
    captured under load, faults injected through `ctl`."""

    CAPTURE = REPO / "tests" / "fixtures" / "h200" / "nvml-capture.json"
    BDF = "0000:00:06.0"  # the H200's address in the capture

    def __init__(self, tmp: Path, config_text: str = "") -> None:
        tmp.mkdir(exist_ok=True)
        (tmp / "sys").mkdir(exist_ok=True)  # no amdgpu card: the GPU is NVML's
        self.sock = str(tmp / "nvml.sock")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "gpuguard.yaml"
        cfg.write_text(f"""
sysfs_root: {tmp / 'sys'}
state_dir: {tmp / 'state'}
recorder: {{enabled: false}}
listen: {{address: 127.0.0.1, port: {self.port}}}
kernel: {{kmsg_path: {tmp / 'no-kmsg'}, udev: false}}
poll: {{interval_seconds: 0.25, discover_seconds: 1, pcie_interval_seconds: 600}}
gpus:
  - {{name: h200, match: {{bdf: "{self.BDF}"}}}}
""" + config_text)
        Proc.__init__(self, "gpuguard on the recorded H200",
                      [sys.executable, "-m", "gpuguard.sim.nvml_host", "--capture", str(self.CAPTURE),
                       "--control", self.sock, "--", "run", "--config", str(cfg)], tmp / "gpuguard.log",
                      env={**os.environ, "PYTHONPATH": str(REPO / "daemon")})
        poll_until(self.healthy, 60, f"gpuguard on the H200 replay {self.base} (log {self.log_path})")

    def ctl(self, op: str, **args):
        from gpuguard.sim.control import send

        return send(self.sock, op, **args)


class Alertmanager(Proc):
    """The shipped example config (its inhibit rules) with the test's receiver and short timings:
    one group per alert (`group_by: ['...']`), so each alert is one notification."""

    def __init__(self, tmp: Path, webhook_url: str) -> None:
        cfg = yaml.safe_load(AM_EXAMPLE.read_text())
        cfg["route"] = {"receiver": "test", "group_by": ["..."], "group_wait": "1s", "group_interval": "1s",
                        "repeat_interval": "1h"}
        cfg["receivers"] = [{"name": "test", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}]
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}/api/v2", timeout=5)
        super().__init__("alertmanager", [ALERTMANAGER, f"--config.file={tmp / 'alertmanager.yml'}",
                                          f"--storage.path={tmp / 'am-data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}",
                                          "--cluster.listen-address=", "--log.level=warn"],
                         tmp / "alertmanager.log", cwd=tmp)
        poll_until(lambda: self.alive() and self._ready(), 60, "alertmanager ready")

    def _ready(self) -> bool:
        try:
            return self.api.get("/status").status_code == 200
        except httpx.HTTPError:
            return False

    def alerts(self) -> list[dict]:
        return self.api.get("/alerts").json()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.api.close()
        super().stop(sig)


class Prometheus(Proc):
    def __init__(self, tmp: Path, rules: Path, target_port: int | list[int], am_port: int) -> None:
        self.port = free_port()
        ports = target_port if isinstance(target_port, list) else [target_port]
        config = {
            "global": {"scrape_interval": "2s", "evaluation_interval": "1s", "scrape_timeout": "2s"},
            "rule_files": [str(rules)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "gpuguard",
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}/api/v1", timeout=5)
        super().__init__("prometheus", [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                        f"--storage.tsdb.path={tmp / 'prom-data'}",
                                        f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                         tmp / "prometheus.log", cwd=tmp)
        poll_until(lambda: self.alive() and self._ready(), 60, "prometheus ready")

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, q: str) -> list[dict]:
        return self.api.get("/query", params={"query": q}).json()["data"]["result"]

    def active_at(self) -> dict[tuple, float]:
        """When each alert of the last 10 minutes went pending (ALERTS_FOR_STATE), by sorted labels."""
        out = {}
        for r in self.query("last_over_time(ALERTS_FOR_STATE[10m])"):
            labels = {k: v for k, v in r["metric"].items() if k != "__name__"}
            out[tuple(sorted(labels.items()))] = float(r["value"][1])
        return out

    def rules(self) -> list[dict]:
        return [r for g in self.api.get("/rules").json()["data"]["groups"] for r in g["rules"]]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.api.close()
        super().stop(sig)


def rfc3339(ts: str) -> float:
    """Alertmanager's timestamps carry nanoseconds; Python reads microseconds."""
    import datetime

    m = re.match(r"(.*?T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", ts)
    assert m, f"not an RFC 3339 time: {ts!r}"
    base, frac, zone = m.groups()
    frac = (frac or "0")[:6]
    zone = "+00:00" if zone == "Z" else zone
    return datetime.datetime.fromisoformat(f"{base}.{frac.ljust(6, '0')}{zone}").timestamp()


class Notifications:
    """Alertmanager's webhook deliveries, flattened: (arrived, status, labels) per alert."""

    def __init__(self, receiver) -> None:
        self.receiver = receiver

    def all(self) -> list[tuple[float, str, dict]]:
        return [(t, a["status"], a["labels"]) for t, body in list(self.receiver.got) for a in body["alerts"]]

    def delays(self, active_at: dict[tuple, float]) -> list[tuple[str, float]]:
        """(alertname, seconds) from the moment Prometheus first saw each firing alert's
        condition (`active_at`, by sorted label items; else its startsAt, which is when it
        fired: the same for `for: 0s`) to its arrival at the receiver."""
        out = []
        for t, body in list(self.receiver.got):
            for a in body["alerts"]:
                if a["status"] == "firing":
                    since = active_at.get(tuple(sorted(a["labels"].items())), rfc3339(a["startsAt"]))
                    out.append((a["labels"]["alertname"], t - since))
        return out

    def of(self, alertname: str, status: str = "firing", **labels) -> list[dict]:
        return [l for _, s, l in self.all() if s == status and l["alertname"] == alertname
                and all(l.get(k) == v for k, v in labels.items())]

    def wait(self, alertname: str, timeout: float, status: str = "firing", **labels) -> list[dict]:
        return poll_until(lambda: self.of(alertname, status, **labels), timeout,
                          f"{status} {alertname} {labels} at the webhook; got {self.summary()}")

    def summary(self) -> list[tuple]:
        return sorted({(s, l["alertname"], l.get("gpu") or l.get("engine") or l.get("instance"),
                        l.get("aer_severity", "")) for _, s, l in self.all()})
