"""No false positives against real engine processes, all watched by one watchdog at once
with a short window (stall_after 2 s): an idle engine, a busy one producing tokens, a
slow-but-progressing one (one step every 0.6 s), and a long llama-server generation whose
completion-time counter (tokens_predicted_total) stays flat while n_decode_total moves."""
from __future__ import annotations

import asyncio
import time

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import engine_cfg, run_watchdog_until
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def test_idle_busy_slow_and_long_generation_never_stall(sims):
    idle = sims("vllm")
    busy = sims("sglang")
    slow = sims("vllm", "--step-time", "0.6")
    longgen = sims("llamacpp")
    busy.control("requests", count=3)
    slow.control("requests", count=1)
    longgen.control("requests", count=1)  # max_tokens effectively unbounded: never released
    cfgs = [engine_cfg(name, s.kind, s.url, process={"cmdline": rf"--kind {s.kind} --port {s.port}( |$)"},
                       stall_after=2.0, poll_interval=0.25, http_timeout=0.5, action="kill", grace=0.5)
            for name, s in (("idle", idle), ("busy", busy), ("slow", slow), ("longgen", longgen))]
    audit, events = [], []
    wd = EngineWatchdog(cfgs, audit.append, events.append)
    seen: dict[str, set] = {n: set() for n in ("idle", "busy", "slow", "longgen")}
    first: dict = {}

    def watch():
        for n, s in wd.snapshots().items():
            seen[n].add(s.state)
            if n == "longgen" and s.heartbeat is not None and "longgen" not in first and s.state == "busy":
                first["longgen"] = s
        return None

    async def scenario():
        t_end = time.monotonic() + 6.0  # three windows
        await run_watchdog_until(wd, lambda: watch() or time.monotonic() > t_end, 10)

    asyncio.run(scenario())
    snaps = wd.snapshots()
    assert audit == [], audit
    assert not [e for e in events if e.kind in ("engine_stalled", "engine_killed", "engine_unhealthy")]
    assert seen["idle"] == {"idle"}
    assert seen["busy"] == {"busy"} and snaps["busy"].tokens_per_second > 10
    assert "stalled" not in seen["slow"] and snaps["slow"].state == "busy"
    assert snaps["slow"].tokens_per_second < 5  # slow indeed
    lg, lg0 = snaps["longgen"], first["longgen"]
    assert lg.state == "busy" and not lg.stalled
    assert lg.generated_tokens_total == lg0.generated_tokens_total == 0  # tokens_predicted_total flat
    assert lg.heartbeat > lg0.heartbeat + 100  # n_decode_total moving
    for s in snaps.values():
        assert s.no_progress_seconds < 2.0
