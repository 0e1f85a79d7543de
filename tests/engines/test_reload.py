"""Issue 13: a reload applies `engines:` changes to the running watchdog — a changed engine
takes its new settings (here its action: alert → kill), a new one is watched, a removed
one is dropped — without restarting the watchdog."""
from __future__ import annotations

import asyncio

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, run_watchdog_until
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def _cfg(name, sim, **kw):
    return engine_cfg(name, sim.kind, sim.url, process={"cmdline": rf"--kind {sim.kind} --port {sim.port}( |$)"},
                      poll_interval=0.2, http_timeout=0.4, stall_after=1.0, grace=0.5, **kw)


def test_reconfigure_adds_removes_and_changes_engines_while_running(sims):
    a, b, c = sims("llamacpp"), sims("vllm"), sims("sglang")
    audit, events = [], []
    wd = EngineWatchdog([_cfg("a", a, action="alert"), _cfg("b", b)], audit.append, events.append)

    async def scenario():
        assert await run_watchdog_until(wd, lambda: set(wd.snapshots()) == {"a", "b"}, 20)
        out = wd.reconfigure([_cfg("a", a, action="kill"), _cfg("c", c)])
        assert out == {"added": ["c"], "removed": ["b"], "changed": ["a"]}
        assert await run_watchdog_until(wd, lambda: set(wd.snapshots()) == {"a", "c"}
                                        and wd.snapshots()["c"].polls >= 2, 20), wd.snapshots()
        # the changed action is in force: a stall of `a` is now killed
        await asyncio.to_thread(a.control, "requests", count=1)
        await asyncio.to_thread(a.control, "stall")
        return await run_watchdog_until(wd, lambda: audit and not alive(a.pid), 30)

    assert asyncio.run(scenario()), [e.message for e in events]
    assert audit[0]["what"] == "kill" and audit[0]["engine"] == "a"
    assert alive(b.pid) and alive(c.pid)
