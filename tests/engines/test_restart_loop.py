"""INCIDENTS §7 end to end with real processes: a power loss mid-compile leaves zero-byte
files; the engine (under a Restart=always stand-in) dies at every start with exit 0; the
watchdog sees the restart loop, scans the cache, renames it `.BROKEN-…` with every file
still inside, and the next start compiles afresh and becomes ready."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import engine_cfg, run_watchdog_until, sim_env
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_restart_loop_quarantines_zero_byte_cache(tmp_path, sims):
    cache = tmp_path / "torch_compile_cache"
    subprocess.run([sys.executable, "-m", "gpuguard.sim.engines", "--kind", "llamacpp", "--port", "1",
                    "--cache-dir", str(cache), "--write-zero-byte-cache", "6"], env=sim_env(), check=True)
    before = _tree(cache)
    assert sum(1 for s in before.values() if s == 0) == 7  # 6 + one .lock, which is not counted
    pidf = tmp_path / "engine.pid"
    sim = sims("llamacpp", "--cache-dir", str(cache), "--pid-file", str(pidf), "--crash-after", "0.5",
               supervise=True, wait_ready=False)
    cfg = engine_cfg("loopy", "llamacpp", sim.url, process={"pid_file": str(pidf)}, poll_interval=0.1,
                     http_timeout=0.3, stall_after=5, cache_scan_interval=0.3,
                     caches=[{"name": "torch_compile", "path": str(cache)}],
                     restart_loop={"count": 3, "window": 60, "quarantine": True})
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)
    zero_counts = []

    def healed():
        zero_counts.append(wd.cache_zero_byte_files("torch_compile"))
        s = wd.snapshots().get("loopy")
        return (any(r["what"] == "quarantine" for r in audit) and s is not None and s.state == "idle"
                and zero_counts[-1] == 0)  # rescanned: the fresh cache has no zero-byte file

    ok = asyncio.run(run_watchdog_until(wd, healed, 30))
    assert ok, f"audit={audit} events={[e.kind for e in events]} snap={wd.snapshots()}"
    assert 6 in zero_counts  # exported before the quarantine
    broken = [p for p in tmp_path.iterdir() if p.name.startswith("torch_compile_cache.BROKEN-")]
    assert len(broken) == 1 and broken[0].name.endswith("-restart-loop-zero-byte")
    assert _tree(broken[0]) == before  # every file kept, sizes unchanged: quarantine, never delete
    # the engine compiled a fresh cache and serves
    after = _tree(cache)
    assert after and all(size > 0 for size in after.values())
    assert None in zero_counts  # between the rename and the recompile there was no cache: absent, not 0
    q = [r for r in audit if r["what"] == "quarantine"][0]
    assert q["who"] == "policy" and q["evidence"]["zero_byte_files"] == 6
    assert q["result"] == {"from": str(cache), "to": str(broken[0])}
    kinds = [e.kind for e in events]
    assert kinds.count("engine_restart_loop") == 1 and "cache_quarantined" in kinds
    assert kinds.count("engine_started") >= 3
    assert wd.actions_total()[("loopy", "quarantine", "restart-loop-zero-byte")] == 1
    assert os.path.exists(pidf)


def test_restart_loop_without_quarantine_policy_only_reports(tmp_path, sims):
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "gpuguard.sim.engines", "--kind", "llamacpp", "--port", "1",
                    "--cache-dir", str(cache), "--write-zero-byte-cache", "2"], env=sim_env(), check=True)
    pidf = tmp_path / "engine.pid"
    sim = sims("llamacpp", "--cache-dir", str(cache), "--pid-file", str(pidf), "--crash-after", "0.3",
               supervise=True, wait_ready=False)
    cfg = engine_cfg("loopy", "llamacpp", sim.url, process={"pid_file": str(pidf)}, poll_interval=0.1,
                     http_timeout=0.3, caches=[{"name": "c", "path": str(cache)}],
                     restart_loop={"count": 3, "window": 60})
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)
    ok = asyncio.run(run_watchdog_until(wd, lambda: any(e.kind == "engine_restart_loop" for e in events), 20))
    assert ok
    loop_ev = [e for e in events if e.kind == "engine_restart_loop"][0]
    assert "zero-byte files in c (2)" in loop_ev.message
    assert cache.is_dir() and not list(tmp_path.glob("cache.BROKEN-*"))
    assert not [r for r in audit if r["what"] == "quarantine"]


def test_restart_loop_quarantines_the_related_triton_folders_with_the_cache(tmp_path, sims):
    """INCIDENTS §7, the sibling cache: the Triton key folders written by the same compile
    are renamed with the broken torch cache, under the same stamp, nothing deleted."""
    cache = tmp_path / "torch_compile_cache"
    subprocess.run([sys.executable, "-m", "gpuguard.sim.engines", "--kind", "llamacpp", "--port", "1",
                    "--cache-dir", str(cache), "--write-zero-byte-cache", "3"], env=sim_env(), check=True)
    triton = tmp_path / "triton" / "cache"
    for key in ("3f2a9c", "b71e04"):  # Triton's per-kernel key folders
        (triton / key).mkdir(parents=True)
        (triton / key / "kernel.hsaco").write_bytes(b"\x7fELF" + b"\0" * 60)
        (triton / key / "__grp__kernel.json").write_text("{}")
    absent = tmp_path / "never-written"
    triton_before = _tree(triton)
    pidf = tmp_path / "engine.pid"
    sim = sims("llamacpp", "--cache-dir", str(cache), "--pid-file", str(pidf), "--crash-after", "0.5",
               supervise=True, wait_ready=False)
    cfg = engine_cfg("loopy", "llamacpp", sim.url, process={"pid_file": str(pidf)}, poll_interval=0.1,
                     http_timeout=0.3, stall_after=5, cache_scan_interval=0.3,
                     caches=[{"name": "torch_compile", "path": str(cache), "related": [str(triton), str(absent)]}],
                     restart_loop={"count": 3, "window": 60, "quarantine": True})
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)
    ok = asyncio.run(run_watchdog_until(wd, lambda: any(r["what"] == "quarantine" for r in audit), 30))
    assert ok, f"audit={audit} events={[e.kind for e in events]}"
    (broken,) = tmp_path.glob("torch_compile_cache.BROKEN-*")
    (moved,) = (tmp_path / "triton").glob("cache.BROKEN-*")
    stamp = broken.name.split(".BROKEN-")[1]
    assert moved.name == f"cache.BROKEN-{stamp}" and stamp.endswith("-restart-loop-zero-byte")  # one set
    assert not triton.exists() and _tree(moved) == triton_before  # renamed, every file kept
    q = [r for r in audit if r["what"] == "quarantine"][0]
    assert q["result"] == {"from": str(cache), "to": str(broken),
                           "related": [{"from": str(triton), "to": str(moved)},
                                       {"from": str(absent), "absent": "yes"}]}
    ev = [e for e in events if e.kind == "cache_quarantined"][0]
    assert f"with it {triton} -> {moved}" in ev.message
