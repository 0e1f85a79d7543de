"""The kernel-event hooks: a gpu_hang on gpu0 kills the engine on gpu0 at once (whatever its
configured action), leaves the engine on gpu1 alone; after a reset, restart runs the
configured restart command."""
from __future__ import annotations

import asyncio
import sys

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, wait_for
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def test_kill_engines_on_gpu_and_restart(tmp_path, sims):
    a = sims("vllm")
    b = sims("llamacpp")
    marker = tmp_path / "restarted"
    cfgs = [
        engine_cfg("a", "vllm", a.url, process={"cmdline": rf"--kind vllm --port {a.port}( |$)"},
                   gpus=["gpu0"], action="alert", grace=1.0),
        engine_cfg("b", "llamacpp", b.url, process={"cmdline": rf"--kind llamacpp --port {b.port}( |$)"},
                   gpus=["gpu1"], action="alert",
                   restart_command=[sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"]),
    ]
    audit, events = [], []
    wd = EngineWatchdog(cfgs, audit.append, events.append)
    a_pids = a.tree()

    async def scenario():
        await wd.poll_once()
        killed = await wd.kill_engines_on_gpu("gpu0", "gpu_hang",
                                              {"line": "amdgpu 0000:03:00.0: ring gfx timeout"})
        restarted = await wd.restart_engines_on_gpu("gpu1", "gpu_reset")
        await wd.aclose()
        return killed, restarted

    killed, restarted = asyncio.run(scenario())
    assert set(killed) == {"a"} and killed["a"]["gone"]
    wait_for(lambda: not any(alive(p) for p in a_pids), 2, what="engine a gone")
    assert all(alive(p) for p in b.tree())
    rec = [r for r in audit if r["what"] == "kill"][0]
    assert rec["engine"] == "a" and rec["why"] == "gpu_hang" and rec["who"] == "policy"
    assert rec["evidence"]["kernel"]["line"].startswith("amdgpu 0000:03:00.0")
    assert rec["evidence"]["gpu"] == "gpu0"
    assert set(restarted) == {"b"} and restarted["b"]["command"]["returncode"] == 0
    assert marker.read_text() == "ok"
    assert wd.actions_total() == {("a", "kill", "gpu_hang"): 1, ("b", "restart", "gpu_reset"): 1}
    killed_ev = [e for e in events if e.kind == "engine_killed"][0]
    assert killed_ev.gpu == "gpu0" and killed_ev.engine == "a" and killed_ev.severity == "alert"
