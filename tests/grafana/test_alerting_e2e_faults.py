"""grafana/alerts.yml end to end, the rules test_alerting_e2e.py does not reach: kernel
lines (through the simulated kernel log's FIFO, `kernel.kmsg_path`, never the machine's own
/dev/kmsg), the PSU budget (the simulator's load model stepping in real time, a `power:`
config), an engine that gpuguard kills three times under a Restart= supervisor, a sensor
file that fails on every poll, and, from a second gpuguard scraped by the same Prometheus,
the NVIDIA rules: `gpuguard run` on the recorded H200 (gpuguard.sim.nvml_host) with faults
injected into the replayed NVML answers (throttle reason bits, ECC and row-remap fields, an
Xid on its event set), its recorded full-load power at its cap (692 of 700 W: the real card
sat there), and its poll task stopped as a gpuguard bug would stop it (GpuguardNotPolling).
Each rule must reach Alertmanager's webhook receiver exactly once per fault, labelled with
the configured GPU (or engine) name, within its scaled `for:` plus two evaluations plus
group_wait and the slack of test_alerting_e2e.SLACK_S."""
from __future__ import annotations

import time

import httpx
import pytest
from support import WebhookReceiver, poll_until

from grafana.alerting_stack import (ALERTMANAGER, PROMETHEUS, Alertmanager, Gpuguard, Notifications, NvmlHost,
                                    Prometheus, Sim, render_rules)
from grafana.test_alerting_e2e import SLACK_S, TRAVEL_S

pytestmark = [
    pytest.mark.slow, pytest.mark.fuse, pytest.mark.network,  # registered in pyproject.toml
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs the Debian packages `prometheus` and `prometheus-alertmanager` (.ci/run installs them)"),
]

R9700_A, R9700_B, XTX0, XTX1 = "0000:05:00.0", "0000:08:00.0", "0000:aa:00.0", "0000:b0:00.0"


@pytest.fixture
def stack(tmp_path):
    from engines.engines_harness import SimEngine

    parts: list = []
    receiver = WebhookReceiver()
    try:
        sim = Sim(tmp_path, step_interval=0.1, kmsg=True)  # the load model steps: power follows load
        parts.append(sim)
        pid_file = tmp_path / "engine.pid"
        engine = SimEngine("vllm", "--pid-file", str(pid_file), supervise=True)  # Restart=always stand-in
        parts.append(engine)
        cfg = f"""
poll: {{interval_seconds: 0.25, discover_seconds: 1, pcie_interval_seconds: 1}}
gpus:
  - {{name: r9700-a, match: {{bdf: "{R9700_A}"}}}}
  - {{name: r9700-b, match: {{bdf: "{R9700_B}"}}}}
  - {{name: xtx-0, match: {{bdf: "{XTX0}"}}}}
  - {{name: xtx-1, match: {{bdf: "{XTX1}"}}}}
kernel: {{udev: false, kmsg_path: "{sim.kmsg_fifo}", state_file: "{tmp_path / 'kmsg-position.json'}"}}
# INCIDENTS §2: 1300 W supply, 450 W for the rest of the host, alert at 975 W of peaks; it
# clears after 5 s 65 W under that line.
power: {{sample_hz: 20, psu_watts: 1300, other_watts: 450, margin_ratio: 0.25, cpu_budget_ratio: 0.5,
        clear_after_seconds: 5}}
engines:
  - {{name: vllm-r, kind: vllm, url: "{engine.url}", process: {{pid_file: "{pid_file}"}}, gpus: [xtx-1],
     stall_after: 1, poll_interval: 0.25, http_timeout: 2, grace: 0.5, action: kill}}
"""
        gg = Gpuguard(tmp_path, sim.mount, cfg)
        parts.append(gg)
        nv = NvmlHost(tmp_path / "h200")
        parts.append(nv)
        am = Alertmanager(tmp_path, receiver.url)
        parts.append(am)
        fors = render_rules(tmp_path / "alerts.test.yml")
        prom = Prometheus(tmp_path, tmp_path / "alerts.test.yml", [gg.port, nv.port], am.port)
        parts.append(prom)
        yield dict(sim=sim, engine=engine, gpuguard=gg, nvml=nv, prom=prom, fors=fors, sent=Notifications(receiver),
                   pid_file=pid_file)
    finally:
        for p in reversed(parts):
            p.stop()
        receiver.close()


def _kills(gg, reason: str) -> float:
    for line in httpx.get(f"{gg.base}/metrics", timeout=5).text.splitlines():
        if (line.startswith("gpuguard_engine_actions_total{") and 'engine="vllm-r"' in line and 'action="kill"' in line
                and f'reason="{reason}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _stall_three_times(engine, gg, pid_file) -> None:
    """Requests running, then no tokens: gpuguard kills the engine, its supervisor starts it
    again, three times (INCIDENTS §7). A kill for another reason (a /metrics answer late on a
    loaded box) restarts the round rather than counting."""
    def pid() -> int:
        return int(pid_file.read_text() or 0) if pid_file.exists() else 0

    deadline = time.monotonic() + 4 * TRAVEL_S
    while _kills(gg, "heartbeat_flat") < 3:
        assert time.monotonic() < deadline, f"3 stall kills of vllm-r (gpuguard log: {gg.log_path})"
        p = poll_until(lambda: engine.answers() and pid(), TRAVEL_S, "the (re)started engine")
        try:
            engine.control("requests", count=2, max_tokens=100000)
        except httpx.HTTPError:
            continue  # killed (or restarting) under our hands: next round
        if not poll_until(lambda: gg.metric('gpuguard_engine_requests_running{engine="vllm-r"}') or pid() != p,
                          TRAVEL_S, f"requests running (gpuguard log: {gg.log_path})") or pid() != p:
            continue
        try:
            engine.control("stall")
        except httpx.HTTPError:
            continue
        poll_until(lambda: pid() != p, TRAVEL_S, "gpuguard's kill and the supervisor's restart")


def test_kernel_power_engine_and_poll_faults_reach_the_webhook_once(stack):
    sim, engine, gg, nv, prom, sent, fors = (stack[k] for k in ("sim", "engine", "gpuguard", "nvml", "prom", "sent",
                                                                "fors"))
    t_start = time.monotonic()
    poll_until(lambda: prom.query('gpuguard_gpu_up{gpu="xtx-1"}') and prom.query('gpuguard_gpu_up{gpu="h200"}'),
               TRAVEL_S, "first scrape of both gpuguards")

    # -- the recorded H200: faults in its NVML answers, in NVML's shapes --------------------------
    nv.ctl("throttle", reasons=["hw_slowdown"])  # beside the recorded sw_power_cap bit of full load
    nv.ctl("field", name="ecc_dbe_volatile", value=1)  # one uncorrectable (double-bit) error
    nv.ctl("field", name="remapped_pending", value=1)
    nv.ctl("field", name="remapped_failure", value=1)
    nv.ctl("xid", xid=13)  # on its event set (nvmlEventSetWait), as the driver raises one

    # -- the AMD host ------------------------------------------------------------------------------
    for bdf in (R9700_A, R9700_B):
        sim.ctl("set_load", bdf=bdf, level=1.0)  # two cards at full load: their peaks reach the PSU line
    sim.ctl("garbage", bdf=XTX0, file="fan1_input", text="not a number\n")  # fails on every poll
    sim.ctl("kmsg", text=f"amdgpu {R9700_A}: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx_0.0.0 timeout, "
                         "signaled seq=1234, emitted seq=1236", level=3, bdf=R9700_A)
    _stall_three_times(engine, gg, stack["pid_file"])

    hang = sent.wait("GpuguardGpuHang", TRAVEL_S, gpu="r9700-a")
    xid = sent.wait("GpuguardNvidiaXid", TRAVEL_S, gpu="h200")
    psu = sent.wait("GpuguardPsuHeadroomLow", TRAVEL_S)
    loop = sent.wait("GpuguardEngineRestartLoop", TRAVEL_S, engine="vllm-r", action="kill")
    sent.wait("GpuguardEngineStalled", TRAVEL_S, engine="vllm-r")
    errors = sent.wait("GpuguardPollErrors", TRAVEL_S + fors["GpuguardPollErrors"], gpu="xtx-0")
    assert hang[0]["severity"] == "critical" and xid[0]["severity"] == "warning"
    assert psu[0]["severity"] == "critical"
    assert loop[0]["reason"] == "heartbeat_flat" and errors[0]["source"] == "amdgpu"

    # INCIDENTS §4: the incident host's own defect, the switch slot hop of each XTX trained at
    # Gen2: one page per GPU (not per end of the link), none for the R9700 pair.
    for gpu in ("xtx-0", "xtx-1"):
        sent.wait("GpuguardPcieLinkDowngraded", TRAVEL_S + fors["GpuguardPcieLinkDowngraded"], gpu=gpu)

    # -- the NVIDIA rules, from the second gpuguard ------------------------------------------------
    hw = sent.wait("GpuguardGpuThrottledHardware", TRAVEL_S + fors["GpuguardGpuThrottledHardware"], gpu="h200")
    ecc = sent.wait("GpuguardGpuEccUncorrectable", TRAVEL_S, gpu="h200")
    failure = sent.wait("GpuguardGpuRowRemapFailure", TRAVEL_S, gpu="h200")
    pending = sent.wait("GpuguardGpuRowRemapPending", TRAVEL_S + fors["GpuguardGpuRowRemapPending"], gpu="h200")
    cap = sent.wait("GpuguardPowerAtCap", TRAVEL_S + fors["GpuguardPowerAtCap"], gpu="h200")
    assert hw[0]["reason"] == "hw_slowdown" and hw[0]["severity"] == "warning"
    assert ecc[0]["severity"] == failure[0]["severity"] == "critical" and pending[0]["severity"] == "warning"
    assert cap[0]["severity"] == "warning"
    assert sent.of("GpuguardGpuThrottledHardware", reason="sw_power_cap") == []  # full load is not a fault

    # -- a gpuguard bug: its poll task ends while its HTTP server answers ---------------------------
    # No hardware fault can do this (test_a_card_blocking_every_read_is_down_and_the_poll_goes_on).
    assert sent.of("GpuguardNotPolling") == []
    nv.ctl("stop_poller")
    stale = sent.wait("GpuguardNotPolling", TRAVEL_S + fors["GpuguardNotPolling"])
    assert stale[0]["instance"] == f"127.0.0.1:{nv.port}" and stale[0]["severity"] == "critical"

    # -- a card falls off the bus: the kernel says so twice (lost, then the failed recovery) -------
    sim.ctl("lose_gpu", bdf=R9700_B)
    lost = sent.wait("GpuguardGpuDeviceLost", TRAVEL_S, gpu="r9700-b")
    failed = sent.wait("GpuguardGpuResetFailed", TRAVEL_S, gpu="r9700-b")
    sent.wait("GpuguardGpuDown", TRAVEL_S, gpu="r9700-b")
    assert lost[0]["severity"] == failed[0]["severity"] == "critical"

    # -- over the whole run ------------------------------------------------------------------------
    assert {r["name"]: r.get("lastError") for r in prom.rules() if r["health"] != "ok"} == {}
    firing = [l for _, s, l in sent.all() if s == "firing"]
    keys = [tuple(sorted(l.items())) for l in firing]
    assert {k for k in keys if keys.count(k) > 1} == set(), f"alerts paged more than once: {sent.summary()}"
    assert {l["alertname"] for l in firing} - {
        "GpuguardGpuHang", "GpuguardNvidiaXid", "GpuguardPsuHeadroomLow", "GpuguardEngineRestartLoop",
        "GpuguardEngineStalled", "GpuguardPollErrors", "GpuguardGpuDeviceLost",
        "GpuguardGpuResetFailed", "GpuguardGpuDown", "GpuguardPcieLinkDowngraded",
        "GpuguardGpuThrottledHardware", "GpuguardGpuEccUncorrectable", "GpuguardGpuRowRemapPending",
        "GpuguardGpuRowRemapFailure", "GpuguardPowerAtCap", "GpuguardNotPolling",
        # the incident host's standing finding: the XTX small BAR; the engine between kill and restart
        "GpuguardLargeBarInactive", "GpuguardEngineDown"} == set(), sent.summary()
    assert {l["gpu"] for l in sent.of("GpuguardPcieLinkDowngraded")} == {"xtx-0", "xtx-1"}
    assert len(sent.of("GpuguardNotPolling")) == 1  # the H200's gpuguard only: the AMD one kept polling
    assert not [l for l in firing if l.get("gpu", "").startswith("card")], "an alert names a GPU by its cardN"
    delays = sent.delays(prom.active_at())
    late = [(name, round(d, 1), fors[name]) for name, d in delays if d > fors[name] + 2 * 1 + 1 + SLACK_S]
    assert late == [], f"pages later than for + 2 evaluations + group_wait (+{SLACK_S} s): {late}"
    assert time.monotonic() - t_start < 200, "the end-to-end run must stay within ~3.5 minutes"


def test_a_card_blocking_every_read_is_down_and_the_poll_goes_on(tmp_path):
    """Every read of every card hangs (a bus that stopped answering): each read is bounded by
    poll.timeout_seconds (poller.py), so every card is reported not answering (GpuguardGpuDown)
    and the cycles go on completing: the poll timestamp keeps moving, GpuguardNotPolling has
    nothing to see. Only a gpuguard bug can stop the poll (shown above with stop_poller)."""
    sim = Sim(tmp_path)
    gg = None
    try:
        gg = Gpuguard(tmp_path, sim.mount, f"""
poll: {{interval_seconds: 0.25, timeout_seconds: 1, discover_seconds: 1, pcie_interval_seconds: 1}}
gpus:
  - {{name: r9700-a, match: {{bdf: "{R9700_A}"}}}}
  - {{name: r9700-b, match: {{bdf: "{R9700_B}"}}}}
  - {{name: xtx-0, match: {{bdf: "{XTX0}"}}}}
  - {{name: xtx-1, match: {{bdf: "{XTX1}"}}}}
kernel: {{enabled: false}}
""")
        names = {R9700_A: "r9700-a", R9700_B: "r9700-b", XTX0: "xtx-0", XTX1: "xtx-1"}
        for bdf in names:
            # every file of the card the poll reads (what the simulator serves for it)
            for f in ("power1_average", "power1_input", "power1_cap", "temp1_input", "temp2_input", "temp3_input",
                      "fan1_input", "in0_input", "gpu_busy_percent", "mem_info_vram_used", "mem_info_vram_total",
                      "mem_info_vis_vram_used", "mem_info_vis_vram_total", "pp_dpm_sclk", "pp_dpm_mclk",
                      "pp_dpm_socclk", "pp_dpm_fclk", "pp_dpm_pcie", "pp_od_clk_voltage",
                      "power_dpm_force_performance_level", "current_link_speed", "current_link_width"):
                sim.ctl("block", bdf=bdf, file=f)

        def ts() -> float:
            return gg.metric('gpuguard_last_poll_timestamp_seconds{source="gpu"}') or 0.0

        poll_until(lambda: all(gg.metric(f'gpuguard_gpu_up{{gpu="{n}"}}') == 0.0 for n in names.values()), 60,
                   f"every card reported not answering (log {gg.log_path})")
        seen = [ts()]
        for _ in range(3):  # three more cycles complete, each within a few poll timeouts
            seen.append(poll_until(lambda: ts() > seen[-1] and ts(), 15, "the next poll cycle"))
    finally:
        for bdf in (R9700_A, R9700_B, XTX0, XTX1):  # a read stuck in FUSE would hold the process in D state
            sim.ctl("unblock", bdf=bdf)
        if gg is not None:
            gg.stop()
        sim.stop()
