"""Time the daemon did not observe is no engine's lack of progress: the real `gpuguard run`
(on a plain simulated tree) watching a real simulated llama-server that decodes, the daemon
SIGSTOPped for twice stall_after while one of its probes was in flight, then continued.
Before, the probe's timeout fired first on resume (the loop's clock had run on), the last
reading stood, and the first poll read "heartbeat_flat (no progress 6.x s)" and killed the
healthy engine (the demo paused 172 s did the same). Now the stall clock restarts at that
poll, and a real stall afterwards is still caught at stall_after."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from support import STARTS

from engines.engines_harness import SimEngine, alive, stopped
from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml

STALL_AFTER, POLL, GRACE, HTTP_TIMEOUT = 3.0, 0.25, 1.0, 0.5
PAUSE = 2 * STALL_AFTER


@pytest.fixture
def engine():
    e = SimEngine("llamacpp")
    yield e
    e.stop()


def _engine(d) -> dict:
    (snap,) = [s for s in httpx.get(f"{d.base}/v1/engines", timeout=5).json() if s["name"] == "llama"]
    return snap


def _kinds(d) -> list[str]:
    return [x["kind"] for x in httpx.get(f"{d.base}/v1/events", timeout=5).json() if x.get("engine") == "llama"]


def test_a_paused_daemon_does_not_count_its_pause_against_a_healthy_engine(tmp_path, start_daemon, engine, wait_for):
    write_tree(build_scenario("incident"), str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    cfg = (f"kernel: {{kmsg_path: {tmp_path / 'kmsg'}, udev: false}}\nengines:\n"
           f"  - {{name: llama, kind: llamacpp, url: \"{engine.url}\", "
           f"process: {{cmdline: 'gpuguard.sim.engines --kind llamacpp --port {engine.port}( |$)'}}, "
           f"stall_after: {STALL_AFTER}, poll_interval: {POLL}, http_timeout: {HTTP_TIMEOUT}, grace: {GRACE}, "
           f"action: kill}}\n")
    d = start_daemon(tmp_path / "root", cfg)
    engine.control("requests", count=1, max_tokens=10**9)
    wait_for(lambda: (s := _engine(d))["state"] == "busy" and s["tokens_per_second"], timeout=STARTS,
             what="the engine decoding under the daemon's watch")

    before = _engine(d)["polls"]
    # Put the pause in the middle of a probe: the engine holds its answers for a moment
    # (well under stall_after), the daemon is stopped while it waits for one, and the
    # engine goes on decoding through the daemon's pause, as the demo's engine did.
    os.kill(engine.pid, signal.SIGSTOP)
    held = time.monotonic()
    try:
        wait_for(lambda: stopped(engine.pid) and _engine(d)["state"] == "unresponsive", timeout=10,
                 what="the daemon's probes waiting on the engine")
        os.kill(d.proc.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(d.proc.pid), timeout=10, what="every thread of the daemon stopped")
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    # what the daemon saw of the engine's hold must stay well under stall_after
    assert time.monotonic() - held < STALL_AFTER - 1, "the daemon was stopped too late to test this"
    try:
        time.sleep(PAUSE)  # the pause under test (not a synchronisation): twice stall_after
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    resumed = time.time()
    # a dozen polls after the pause: the poll that killed, before, was the first of them
    wait_for(lambda: (s := _engine(d))["polled_at"] > resumed and s["polls"] >= before + 12, timeout=30,
             what="a dozen polls after the daemon's pause")
    kinds = _kinds(d)
    assert "engine_stalled" not in kinds and "engine_killed" not in kinds, kinds
    assert alive(engine.pid) and _engine(d)["state"] == "busy"
    # (a loaded box can hold a starting daemon's loop for seconds too: only this pause's gap)
    gap = [x for x in httpx.get(f"{d.base}/v1/events", timeout=5).json()
           if x["kind"] == "engine_watch_gap" and x["time"] >= resumed - 0.5]
    assert len(gap) == 1 and gap[0]["engine"] == "llama", gap
    assert PAUSE - 1 <= gap[0]["fields"]["unobserved_seconds"] <= PAUSE + 5, gap

    # a real stall after the pause is still caught, at stall_after
    tree = engine.tree()
    engine.control("stall")
    t0 = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in tree), timeout=STALL_AFTER + POLL + GRACE + HTTP_TIMEOUT + 10,
             what="the stalled engine killed")
    elapsed = time.monotonic() - t0
    assert STALL_AFTER - POLL <= elapsed, elapsed
    kinds = _kinds(d)
    assert "engine_stalled" in kinds and "engine_killed" in kinds
