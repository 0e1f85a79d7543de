"""Real processes: a simulated engine told to stall is killed by the real watchdog loop
within stall_after + one poll interval + grace; all its processes (vLLM: the API server and
its EngineCore child) are gone; the audit record carries the evidence."""
from __future__ import annotations

import asyncio
import time

from gpuguard.engines.metrics import engine_metrics
from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, run_watchdog_until
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


STALL_AFTER, POLL, GRACE, HTTP_TIMEOUT = 2.0, 0.25, 1.0, 0.2
# The poll that decides may wait out one HTTP timeout (a wedged /metrics); on top of that,
# scheduling slack on a 2-core CI box (process exit, HTTP round trips).
SLACK = 0.4
BOUND = STALL_AFTER + POLL + GRACE + HTTP_TIMEOUT + SLACK


def _watch(sim, kind, **kw):
    opts = dict(gpus=["gpu0"], stall_after=STALL_AFTER, poll_interval=POLL, http_timeout=HTTP_TIMEOUT,
                grace=GRACE, action="kill")
    return engine_cfg(f"{kind}0", kind, sim.url, process={"cmdline": rf"--kind {kind} --port {sim.port}( |$)"},
                      **{**opts, **kw})


def _stall_and_watch(sim, cfg):
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)
    pids = sim.tree()

    async def scenario():
        # busy and progressing first
        got = await run_watchdog_until(wd, lambda: (s := wd.snapshots().get(cfg.name)) and s.state == "busy"
                                       and s.tokens_per_second, 10)
        assert got, f"engine never busy: {wd.snapshots()}"
        await asyncio.to_thread(sim.control, "stall")
        t_stall = time.monotonic()  # the core has stopped stepping when the control returns
        done = await run_watchdog_until(wd, lambda: audit and not any(alive(p) for p in pids), 15)
        return time.monotonic() - t_stall, done

    elapsed, done = asyncio.run(scenario())
    assert done, f"not killed; audit={audit} snapshots={wd.snapshots()}"
    return elapsed, audit, events, pids, wd


def test_stalled_vllm_killed_with_engine_core(sims):
    sim = sims("vllm", "--step-time", "0.01")
    sim.control("requests", count=2)
    pids = sim.tree()
    assert len(pids) == 2, "the vLLM sim runs its EngineCore as a child process"
    elapsed, audit, events, pids, wd = _stall_and_watch(sim, _watch(sim, "vllm"))
    assert elapsed <= BOUND, f"kill took {elapsed:.2f} s"
    assert not any(alive(p) for p in pids)
    rec = audit[0]
    assert rec["what"] == "kill" and rec["who"] == "policy" and rec["why"] == "heartbeat_flat"
    ev = rec["evidence"]
    assert ev["running"] == 2 and ev["no_progress_seconds"] >= STALL_AFTER - 0.1 * POLL  # poll jitter tolerance
    assert ev["health"] == "ready"  # the vLLM blind spot: /health 200 while the core is hung
    assert ev["gpu_pid"] == pids[1] and ev["gpu_pid"] != pids[0]  # CPU read from the EngineCore
    assert set(rec["result"]["pids"]) >= set(pids) and rec["result"]["gone"]
    assert not rec["result"]["escalated"]  # it honoured SIGTERM
    kinds = [e.kind for e in events]
    assert "engine_stalled" in kinds and "engine_killed" in kinds
    assert wd.actions_total() == {("vllm0", "kill", "heartbeat_flat"): 1}
    # The stalled gauge was 1 only until the kill; the counter keeps the stall for Prometheus (issue 21).
    assert wd.stalls_total() == {("vllm0", "heartbeat_flat"): 1}
    fams = {m.name: m for m in engine_metrics(wd)}
    assert [(s.labels, s.value) for s in fams["gpuguard_engine_stalls"].samples if s.name.endswith("_total")] \
        == [({"engine": "vllm0", "reason": "heartbeat_flat"}, 1.0)]


def test_stalled_engine_ignoring_sigterm_gets_sigkill(sims):
    sim = sims("llamacpp", "--ignore-sigterm")
    sim.control("requests", count=1)
    elapsed, audit, events, pids, wd = _stall_and_watch(sim, _watch(sim, "llamacpp"))
    assert elapsed <= BOUND, f"kill took {elapsed:.2f} s"
    res = audit[0]["result"]
    assert res["escalated"] and res["gone"]
    assert any(s.startswith("SIGTERM") for s in res["signals"])
    assert any(s.startswith("SIGKILL") for s in res["signals"])
    assert audit[0]["evidence"]["running"] == 1
    # llama-server's /metrics is a main-loop task: it stops answering when the loop wedges
    assert audit[0]["evidence"]["metrics_error"] == "timeout"


def test_stalled_sglang_scheduler_spin_is_evidence(sims):
    sim = sims("sglang")
    sim.control("requests", count=3)
    elapsed, audit, events, pids, wd = _stall_and_watch(sim, _watch(sim, "sglang", health_timeout=0.2))
    assert elapsed <= BOUND, f"kill took {elapsed:.2f} s"
    ev = audit[0]["evidence"]
    assert ev["running"] == 3 and ev["gpu_pid"] == pids[1]
    # the scheduler spins one core (measured from /proc over the window)
    assert ev["cpu_percent"] is not None and ev["cpu_percent"] > 30


def test_unhealthy_sglang_with_act_on_unhealthy_off_is_alerted_not_killed(sims):
    """`act_on_unhealthy: false`: failing health alone (SGLang's /health answering 503 while
    its scheduler is stuck) is alerted, never acted on, whatever `action` says."""
    sim = sims("sglang", "--health-check-timeout", "0.2")
    pids = sim.tree()
    assert len(pids) == 2, "the SGLang sim runs its scheduler as a child process"
    # unhealthy_after well under stall_after: the failing health is what is judged (the
    # stuck scheduler's CPU spin would be a stall only after stall_after)
    cfg = _watch(sim, "sglang", stall_after=60.0, unhealthy_after=1.0, health_timeout=1.0, act_on_unhealthy=False)
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get(cfg.name)) and s.state == "idle"
                                        and s.health == "ready", 20), wd.snapshots()
        await asyncio.to_thread(sim.control, "stall")  # the scheduler stops answering the health probe
        return await run_watchdog_until(
            wd, lambda: (s := wd.snapshots().get(cfg.name)) and s.last_action is not None and s, 20)

    snap = asyncio.run(scenario())
    assert snap, f"never acted; events={[e.kind for e in events]} snapshots={wd.snapshots()}"
    unhealthy = [e for e in events if e.kind == "engine_unhealthy"]
    assert unhealthy and unhealthy[0].fields["reason"] == "health_failing", [e.kind for e in events]
    assert snap.last_action == "alert (health_failing)" and snap.health == "failed", snap
    assert "engine_killed" not in [e.kind for e in events] and audit == []
    assert all(alive(p) for p in pids) and wd.actions_total() == {}
