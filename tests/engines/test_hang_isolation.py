"""An engine that accepts connections and never answers is evidence, not a hang of
gpuguard: the other engine keeps its poll cadence and the event loop stays responsive."""
from __future__ import annotations

import asyncio
import time

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import engine_cfg, run_watchdog_until
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def test_hung_engine_does_not_delay_others(sims):
    hung = sims("vllm")
    ok = sims("llamacpp")
    ok.control("requests", count=1)
    hung.control("hang")
    poll = 0.2
    cfgs = [
        engine_cfg("hung", "vllm", hung.url, process={"cmdline": rf"--kind vllm --port {hung.port}( |$)"},
                   poll_interval=poll, http_timeout=3.0, stall_after=30),
        engine_cfg("ok", "llamacpp", ok.url, process={"cmdline": rf"--kind llamacpp --port {ok.port}( |$)"},
                   poll_interval=poll, http_timeout=3.0, stall_after=30),
    ]
    wd = EngineWatchdog(cfgs, lambda r: None, lambda e: None)
    lateness: list[float] = []
    ok_polls: list[float] = []

    async def ticker():  # "gpuguard's other work" on the same loop
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.05)
            lateness.append(time.monotonic() - t - 0.05)

    def record():
        s = wd.snapshots().get("ok")
        if s is not None and (not ok_polls or ok_polls[-1] != s.polled_at):
            ok_polls.append(s.polled_at)
        return None

    async def scenario():
        tick = asyncio.create_task(ticker())
        t_end = time.monotonic() + 4.0
        await run_watchdog_until(wd, lambda: record() or time.monotonic() > t_end, 6, interval=0.01)
        tick.cancel()

    asyncio.run(scenario())
    snaps = wd.snapshots()
    # the hung engine's polls take the full 3 s timeout: at most 2 in 4 s
    assert snaps["hung"].polls <= 2
    assert snaps["hung"].health == "timeout" and snaps["hung"].metrics_error == "timeout"
    # the healthy one kept its 0.2 s cadence the whole time
    # (from the second poll on: the first one pays for starting the thread pool and client)
    gaps = [b - a for a, b in zip(ok_polls[1:], ok_polls[2:])]
    assert len(ok_polls) >= 4.0 / poll - 3, ok_polls
    assert max(gaps) < poll + 0.25, gaps
    assert snaps["ok"].state == "busy"
    assert max(lateness) < 0.2, f"event loop blocked {max(lateness):.3f} s"
