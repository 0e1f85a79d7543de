"""grafana/alerts.yml end to end across a scrape gap longer than a rule's window: gpuguard
(on the simulated host, kernel lines through the simulator's kmsg FIFO) is SIGSTOPped right
after its counter alerts fired, for longer than their window, then let go. Prometheus and
Alertmanager are the real ones (alerting_stack.py); the rules are the shipped expressions
with `for:` and, here, the ranges and offsets scaled (10 min -> 15 s), nothing else.

While gpuguard does not answer, an alert still true (its event inside its window) stays
firing: the `x unless x offset w` branch of old went stale with the target and resolved
GpuguardGpuDeviceLost of a card still lost within seconds. When it answers again, nothing
old fires again: after a gap longer than the window, `x offset w` fell in the gap and every
old counter looked new (12 old alerts re-paged through the example routing)."""
from __future__ import annotations

import signal
import time

import pytest
from support import WebhookReceiver, poll_until

from grafana.alerting_stack import (ALERTMANAGER, PROMETHEUS, Alertmanager, Gpuguard, Notifications, Prometheus, Sim,
                                    render_rules, seconds)
from grafana.test_alerting_e2e import TRAVEL_S

pytestmark = [
    pytest.mark.slow, pytest.mark.fuse, pytest.mark.network,  # registered in pyproject.toml
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs the Debian packages `prometheus` and `prometheus-alertmanager` (.ci/run installs them)"),
]

R9700_A, R9700_B = "0000:05:00.0", "0000:08:00.0"
WINDOW_SCALE = 1 / 40
WINDOW_S = seconds("10m") * WINDOW_SCALE  # the kernel rules' window, scaled: 15 s
COUNTER_ALERTS = ("GpuguardGpuHang", "GpuguardGpuDeviceLost", "GpuguardGpuResetFailed")


def firing(prom: Prometheus) -> set[tuple[str, str]]:
    return {(r["metric"]["alertname"], r["metric"].get("gpu", "")) for r in prom.query('ALERTS{alertstate="firing"}')}


def active_at(prom: Prometheus) -> dict[str, float]:
    """When each firing counter alert became active (Prometheus' rules API)."""
    from grafana.alerting_stack import rfc3339

    return {r["name"]: rfc3339(a["activeAt"]) for r in prom.rules() if r["name"] in COUNTER_ALERTS
            for a in r.get("alerts", []) if a["state"] == "firing"}


def test_counter_alerts_neither_resolve_while_gpuguard_is_stopped_nor_fire_again_after(tmp_path):
    parts: list = []
    receiver = WebhookReceiver()
    try:
        sim = Sim(tmp_path, step_interval=0.1, kmsg=True)  # the loss plays out in simulated steps
        parts.append(sim)
        gg = Gpuguard(tmp_path, sim.mount, f"""
poll: {{interval_seconds: 0.25, discover_seconds: 1, pcie_interval_seconds: 60}}
gpus:
  - {{name: r9700-a, match: {{bdf: "{R9700_A}"}}}}
  - {{name: r9700-b, match: {{bdf: "{R9700_B}"}}}}
kernel: {{udev: false, kmsg_path: "{sim.kmsg_fifo}", state_file: "{tmp_path / 'kmsg-position.json'}"}}
""")
        parts.append(gg)
        am = Alertmanager(tmp_path, receiver.url)
        parts.append(am)
        render_rules(tmp_path / "alerts.test.yml", window_scale=WINDOW_SCALE)
        prom = Prometheus(tmp_path, tmp_path / "alerts.test.yml", gg.port, am.port)
        parts.append(prom)
        sent = Notifications(receiver)
        # a few answered scrapes first: what the counters are judged new against
        poll_until(lambda: len(prom.query("count_over_time(gpuguard_build_info[1m]) >= 3")), TRAVEL_S,
                   "three answered scrapes")

        # r9700-a hangs; r9700-b falls off the bus (the kernel: lost, then the failed recovery)
        sim.ctl("kmsg", text=f"amdgpu {R9700_A}: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx_0.0.0 timeout, "
                             "signaled seq=1234, emitted seq=1236", level=3, bdf=R9700_A)
        sim.ctl("lose_gpu", bdf=R9700_B)
        for name in COUNTER_ALERTS:
            sent.wait(name, TRAVEL_S)
        since = active_at(prom)
        assert set(since) == set(COUNTER_ALERTS), since

        # -- gpuguard stops answering for longer than the window ------------------------------------
        gg.proc.send_signal(signal.SIGSTOP)
        t_stop = time.time()
        resolved_at: dict[str, float] = {}
        try:
            poll_until(lambda: prom.query('up{job="gpuguard"} == 0'), 30, "the first failed scrape")
            while time.time() < t_stop + WINDOW_S + 6:  # past every window, with the last scrapes failed
                now, up = time.time(), firing(prom)
                for name in COUNTER_ALERTS:
                    if (name, "r9700-a" if name == "GpuguardGpuHang" else "r9700-b") not in up:
                        resolved_at.setdefault(name, now)
                time.sleep(0.25)
            # an event still inside its window while gpuguard was stopped stayed firing: resolved
            # no earlier than its window after it became active (less a scrape interval and the slack of a late evaluation)
            early = {n: round(t - since[n], 1) for n, t in resolved_at.items() if t < since[n] + WINDOW_S - 4}
            assert early == {}, f"resolved while still true, seconds after firing: {early} (window {WINDOW_S} s)"
            assert ("GpuguardGpuDown", "r9700-b") in firing(prom)  # the gauge alert is held
        finally:
            gg.proc.send_signal(signal.SIGCONT)

        # -- gpuguard answers again: nothing old fires again -----------------------------------------
        t_resume = time.time()
        poll_until(lambda: prom.query('up{job="gpuguard"} == 1'), 30, "an answered scrape after SIGCONT")
        while time.time() < t_resume + 8:  # 4 scrapes, 8 evaluations: the old rules re-fired within 2 s
            again = {a for a in firing(prom) if a[0] in COUNTER_ALERTS}
            assert again == set(), f"old alerts fired again after the gap: {again}"
            time.sleep(0.25)
        assert gg.proc.poll() is None and gg.healthy()
        for name in (*COUNTER_ALERTS, "GpuguardGpuDown"):
            assert len(sent.of(name)) == 1, f"{name} paged {len(sent.of(name))} times: {sent.summary()}"
        assert {r["name"]: r.get("lastError") for r in prom.rules() if r["health"] != "ok"} == {}
    finally:
        for p in reversed(parts):
            p.stop()
        receiver.close()
