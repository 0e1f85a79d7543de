"""The simulated engines behave like the real ones where it matters to the watchdog
(ENGINES.md): vLLM does not answer at all while loading, and when its EngineCore dies the
API server answers 503 and exits by itself; SGLang's /health turns 503 when its scheduler is
stuck; llama-server keeps /health 200 while /metrics blocks."""
from __future__ import annotations

import asyncio
import time

import httpx

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, run_watchdog_until, wait_for
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def test_vllm_loading_is_starting_then_ready_from_pid_start(sims):
    sim = sims("vllm", "--ready-after", "1.5", wait_ready=False)
    cfg = engine_cfg("v", "vllm", sim.url, process={"cmdline": rf"--kind vllm --port {sim.port}( |$)"},
                     poll_interval=0.1, http_timeout=0.3, stall_after=0.5)
    wd = EngineWatchdog([cfg], lambda r: None, lambda e: None)
    states = []

    def ready():
        s = wd.snapshots().get("v")
        if s:
            states.append((s.state, s.health))
        return s is not None and s.state == "idle" and s

    s = asyncio.run(run_watchdog_until(wd, ready, 15))
    assert s, states
    assert ("starting", "timeout") in states  # port bound, nothing answers while loading
    assert "stalled" not in {x for x, _ in states}
    assert 1.5 <= s.time_to_ready_seconds < 3.0


def test_vllm_engine_core_death_then_api_exit(sims):
    sim = sims("vllm", "--watchdog-time", "1")
    pids = sim.tree()
    cfg = engine_cfg("v", "vllm", sim.url, process={"cmdline": rf"--kind vllm --port {sim.port}( |$)"},
                     poll_interval=0.1, http_timeout=0.3, unhealthy_after=0.3)
    events = []
    wd = EngineWatchdog([cfg], lambda r: None, events.append)

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("v")) and s.state == "idle", 10)
        t0 = time.monotonic()
        await asyncio.to_thread(sim.control, "die")
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("v")) and s.state == "down", 10)
        return time.monotonic() - t0

    took = asyncio.run(scenario())
    kinds = [e.kind for e in events]
    assert "engine_unhealthy" in kinds and "engine_down" in kinds  # 503 first, then the exit
    assert kinds.index("engine_unhealthy") < kinds.index("engine_down")
    assert took < 3.0 and not any(alive(p) for p in pids)


def test_sglang_stuck_scheduler_health_503_and_llama_metrics_block(sims):
    sg = sims("sglang", "--health-check-timeout", "0.5")
    ll = sims("llamacpp")
    sg.control("requests", count=1)
    ll.control("requests", count=1)
    sg.control("stall")
    ll.control("stall")
    r = httpx.get(sg.url + "/health", timeout=5)
    assert r.status_code == 503
    m1 = httpx.get(sg.url + "/metrics", timeout=2).text
    time.sleep(0.2)
    assert httpx.get(sg.url + "/metrics", timeout=2).text == m1  # frozen values, still 200
    assert httpx.get(ll.url + "/health", timeout=2).status_code == 200
    try:
        httpx.get(ll.url + "/metrics", timeout=0.5)
        raise AssertionError("llama-server /metrics answered while its main loop is wedged")
    except httpx.TimeoutException:
        pass
    ll.control("unstall")
    assert httpx.get(ll.url + "/metrics", timeout=2).status_code == 200
    wait_for(lambda: httpx.get(sg.url + "/health", timeout=5).status_code == 503, 2, what="still stuck")
