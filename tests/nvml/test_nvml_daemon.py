"""NVIDIA cards under `gpuguard run`: the daemon's profile lifecycle drives NVML, not
amdgpu sysfs (issue 18). The in-process daemon polls a fake NVML (tests/nvml/fake_nvml.py:
NVML's rules for limits and clocks, the recorded H200's answers for the rest) as its
NVML source: apply-at-start before READY, a card that refuses, a card that appears late,
drift after a GPU reset, and the control API's apply over real HTTP, each with the exact
NVML set-calls per card."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx

from gpuguard.config import load_config
from gpuguard.daemon import Daemon
from gpuguard.hw.nvml import NvmlSource
from gpuguard.hw.nvml_replay import NvmlTimeline
from gpuguard.state.audit import profile_records

from .fake_nvml import CAPTURE, FakeCard, FakeNvml
import pytest

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


A, B, C = "0000:19:00.0", "0000:3b:00.0", "0000:5d:00.0"
TOKEN = "nvml-daemon-test-token-0123456789abcdef"
QUIET = ["nvmlDeviceSetPowerManagementLimit(450000)", "nvmlDeviceSetGpuLockedClocks(1410, 1410)",
         "nvmlDeviceSetMemoryLockedClocks(2201, 2201)"]


def write_config(tmp_path: Path, wait_for: int) -> Path:
    (tmp_path / "sys").mkdir()  # no amdgpu card: every GPU is NVML's
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"ops: {TOKEN}\n")
    os.chmod(tokens, 0o600)
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"""
sysfs_root: {tmp_path / 'sys'}
state_dir: {tmp_path / 'state'}
recorder: {{enabled: false}}
listen: {{address: 127.0.0.1, port: 0}}
api: {{token_file: {tokens}}}
kernel: {{enabled: false}}
poll: {{interval_seconds: 0.2, discover_seconds: 0.5, pcie_interval_seconds: 600}}
profiles:
  quiet: {{power_cap_w: 450, sclk_min_mhz: 1410, sclk_max_mhz: 1410, mclk_max_mhz: 2201}}
  low: {{power_cap_w: 300}}
apply: {{wait_for_gpus: {wait_for}, wait_timeout_seconds: 30, backoff_seconds: 0.01}}
gpus:
  - {{name: h200-a, match: {{bdf: "{A}"}}, profile: quiet}}
  - {{name: h200-b, match: {{bdf: "{B}"}}, profile: quiet}}
  - {{name: h200-c, match: {{bdf: "{C}"}}, profile: quiet}}
""")
    return cfg


def fake_host(appears_after: dict[int, int]) -> FakeNvml:
    """Three H200s; h200-b's driver refuses this caller (NoPermission, as a vGPU does)."""
    return FakeNvml([FakeCard(A, "GPU-a"), FakeCard(B, "GPU-b", no_permission=True), FakeCard(C, "GPU-c")],
                    appears_after=appears_after, telemetry=NvmlTimeline(json.loads(CAPTURE.read_text())))


async def until(task, cond, what, timeout=60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (r := cond()):
        assert not task.done(), task.exception() if not task.cancelled() else "cancelled"
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return r


def state(d, bdf):
    return d.gpus.get(bdf).profile_state


def verified(tmp_path, gpu):
    return [r for r in profile_records(tmp_path / "state" / "audit.jsonl") if r["action"] == "verified" and r["gpu"] == gpu]


def test_nvidia_cards_are_applied_verified_refused_late_reapplied_and_api_applied(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    nv = fake_host({2: 10**9})  # h200-c is not on the bus yet
    cfg = load_config(write_config(tmp_path, wait_for=2))
    events: list = []
    at_ready: dict = {}

    async def main():
        d = Daemon(cfg, sources=[NvmlSource(nv)])
        d.hub.on_event(events.append)

        def before_ready():  # runs after the profiles' start hook, before READY=1
            at_ready.update(states={b: state(d, b) for b in (A, B)}, writes={i: nv.writes_of(i) for i in range(3)},
                            ready=d.profiles.ready)

        d.on_ready.append(before_ready)
        task = asyncio.create_task(d.run())
        try:
            await until(task, lambda: at_ready, "READY")
            # apply-at-start: h200-a verified through NVML before READY, one card at a time
            assert at_ready["ready"] and at_ready["states"] == {A: "verified", B: "unverified"}
            assert at_ready["writes"] == {0: QUIET, 1: [], 2: []}
            ra = d.profiles.ledger.results["h200-a"]
            assert ra.verified and ra.readback["power_cap_w"] == 450 and ra.before["power_cap_w"] == 700
            assert nv.cards[0].limit_mw == 450_000 and nv.cards[0].gpu_locked == (1410, 1410)
            # the refusing card: unverified with NVML's reason, nothing changed on it
            rb = d.profiles.ledger.results["h200-b"]
            assert rb.result == "refused" and "NVMLError_NoPermission" in rb.message, rb
            assert "amdgpu" not in rb.message
            assert nv.cards[1].limit_mw == 700_000 and nv.cards[1].gpu_locked is None
            scrape = d.metrics.render().decode()
            assert 'gpuguard_profile_verified{gpu="h200-a",profile="quiet"} 1.0' in scrape
            assert 'gpuguard_profile_verified{gpu="h200-b",profile="quiet"} 0.0' in scrape
            await until(task, lambda: d.hub.notes.get("profiles"), "the STATUS= note")
            assert d.hub.notes["profiles"] == "profile unverified: h200-b (refused)"
            assert any(e.kind == "profile_unverified" and e.gpu == "h200-b" for e in events)

            # a card that appears late is applied when it appears
            nv.appears_after[2] = 0
            # The audit record is written before the card's state is set (CI read `pending`
            # between the two): wait for both.
            await until(task, lambda: verified(tmp_path, "h200-c") and state(d, C) == "verified", "h200-c verified")
            assert "appeared" in verified(tmp_path, "h200-c")[0]["why"]
            assert nv.writes_of(2) == QUIET and state(d, C) == "verified"
            assert nv.writes_of(0) == QUIET  # the others were not written again

            # a GPU reset puts the defaults back silently: drift, re-applied
            n = len(verified(tmp_path, "h200-a"))
            nv.reset_gpu(0)
            again = await until(task, lambda: verified(tmp_path, "h200-a")[n:], "h200-a re-applied")
            assert again[0]["why"].startswith("drift: power_cap_w 450→700"), again[0]["why"]
            assert nv.writes_of(0) == QUIET + QUIET
            assert nv.cards[0].limit_mw == 450_000 and nv.cards[0].gpu_locked == (1410, 1410)
            drift = [e for e in events if e.kind == "profile_drift"]
            assert drift and drift[0].gpu == "h200-a" and "sclk_locked_mhz" in drift[0].fields["drift"]
            assert nv.writes_of(1) == [] and nv.writes_of(2) == QUIET  # the refusing card is not retried each cycle

            # the control API over real HTTP: same applier, same read-back
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{d.bound_port}", timeout=30) as http:
                r = await http.post("/v1/gpus/h200-c/apply", json={"profile": "low", "reason": "test"},
                                    headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 200, r.text
                assert r.json()["result"]["verified"] is True
                assert r.json()["result"]["readback"]["power_cap_w"] == 300
                assert nv.writes_of(2) == QUIET + ["nvmlDeviceSetPowerManagementLimit(300000)"]
                r = await http.post("/v1/gpus/h200-b/apply", json={"profile": "low"},
                                    headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 409 and "NVMLError_NoPermission" in r.text, r.text
                # NVML has no getter for locked clocks: a confirm window could not restore
                # and verify the state before, so it is refused by name, nothing written
                r = await http.post("/v1/gpus/h200-c/apply", json={"profile": "quiet", "confirm_within": 60},
                                    headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 409 and "locked clocks" in r.text, r.text
            assert nv.cards[2].limit_mw == 300_000
            api = [x for x in profile_records(tmp_path / "state" / "audit.jsonl") if x["who"] == "api:ops"
                   and x["action"] == "write"]
            assert [(x["gpu"], x["nvml"], x["result"]) for x in api] == [
                ("h200-c", "nvmlDeviceSetPowerManagementLimit(300000)", "ok"),
                ("h200-b", "nvmlDeviceSetPowerManagementLimit(300000)", "error")]  # tried, refused, audited
        finally:
            d.request_stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_a_clock_held_below_its_lock_by_the_power_cap_is_not_drift():
    from gpuguard.profiles.drift import drift
    from gpuguard.state.snapshot import GpuSnapshot

    expected = {"power_cap_w": 700, "sclk_locked_mhz": "1755-1755"}

    def snap(mhz, active):
        return GpuSnapshot(name="h200", bdf=A, vendor="10de", device_id="2335", driver="nvidia", model="H200",
                           card=None, up=True, time=0.0, power_cap_watts=700.0, clocks_hz={"sclk": mhz * 1e6},
                           extra={"nvml": {"throttle": {"active": active}}})

    # the H200 under load: 1440 MHz with SW power cap, the lock still set
    assert drift(snap(1440, ["sw_power_cap"]), expected) == {}
    # idle at 345 MHz with nothing holding it: the lock is gone (a reset)
    assert drift(snap(345, ["gpu_idle"]), expected) == {"sclk_locked_mhz": ("1755-1755", 345)}
    assert drift(snap(1980, []), expected) == {"sclk_locked_mhz": ("1755-1755", 1980)}


# -- NVML's event set in the daemon ------------------------------------------------------

H200_BDF = "0000:00:06.0"  # the lent H200's address in the capture


def test_an_nvml_xid_79_in_a_running_daemon_marks_the_gpu_lost_and_kills_its_engine(tmp_path, monkeypatch):
    """The watcher is wired into `gpuguard run` (hw/nvml_events.start from the daemon's
    kernel sources): the recorded H200 as the daemon's NVML source, its real event set,
    and an Xid 79 raised while the daemon runs."""
    import copy

    from engines.engines_harness import SimEngine, alive
    from gpuguard.hw import nvml_calls as C

    from .test_nvml_events import registering_critical_types

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    cap = registering_critical_types(json.loads(CAPTURE.read_text()))
    real = next(e for e in cap["events"] if "result" in e)
    cap["events"] = cap["events"][:3]  # a few of the clock changes it delivered: not news
    tl = NvmlTimeline(cap)
    xid = copy.deepcopy(real)
    xid["result"]["__struct__"].update(eventType=C.EVENT_XID, eventData=79)
    (tmp_path / "sys").mkdir()
    e = SimEngine("vllm")
    try:
        cfg = tmp_path / "gpuguard.yaml"
        cfg.write_text(f"""
sysfs_root: {tmp_path / 'sys'}
state_dir: {tmp_path / 'state'}
recorder: {{enabled: false}}
listen: {{address: 127.0.0.1, port: 0}}
kernel: {{kmsg_path: {tmp_path / 'no-kmsg'}, udev: false}}
poll: {{interval_seconds: 0.2, discover_seconds: 0.5, pcie_interval_seconds: 600}}
gpus:
  - {{name: h200, match: {{bdf: "{H200_BDF}"}}}}
engines:
  - {{name: vllm-h200, kind: vllm, url: "{e.url}", process: {{pid_file: null, cmdline: 'gpuguard.sim.engines --kind vllm --port {e.port}'}}, gpus: [h200], stall_after: 600, poll_interval: 0.25, http_timeout: 0.5, grace: 1, action: alert}}
""")
        config = load_config(cfg)
        events: list = []
        tree = e.tree()

        async def main():
            d = Daemon(config, sources=[NvmlSource(tl)])
            d.hub.on_event(events.append)
            task = asyncio.create_task(d.run())
            try:
                await until(task, lambda: any(t.get_name() == "nvml-events" for t in d.tasks), "the NVML watcher")
                await until(task, lambda: tl._event_pos >= 3, "the recorded events taken")
                await until(task, lambda: (s := d.engines.snapshots().get("vllm-h200")) and s.state in ("ready", "idle"),
                            "the engine watched")
                assert not d.gpus.is_lost(H200_BDF) and not [x for x in events if x.kind == "nvidia_xid"]
                tl.deliver(xid)  # the card falls off the bus
                await until(task, lambda: d.gpus.is_lost(H200_BDF), "the H200 lost")
                await until(task, lambda: not any(alive(p) for p in tree), "the engine on it killed", timeout=15)
                kinds = [(x.kind, x.source) for x in events if x.gpu == "h200"]
                assert ("nvidia_xid", "nvml") in kinds and ("device_lost", "nvml") in kinds, kinds
                x = next(x for x in events if x.kind == "nvidia_xid")
                assert x.severity == "critical" and x.fields["xid"] == 79
                assert d.kernel_router.counts[("h200", "nvidia_xid")] == 1
                assert not d.gpus.may_write(H200_BDF)  # nothing writes to it until it reappears
            finally:
                d.request_stop()
                await asyncio.wait_for(task, 30)

        asyncio.run(main())
        audit = [json.loads(ln) for ln in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]
        kill = [a for a in audit if a["what"] == "engine.kill" and a["target"] == "vllm-h200"]
        assert kill and kill[0]["who"] == "policy" and "device_lost" in json.dumps(kill[0]), kill
    finally:
        e.stop()
