"""Issue 13 against real simulated-engine processes (INCIDENTS §9 and §1 replayed):

- llama-server computes a prompt batch inside one llama_decode: /metrics answers nothing and
  no counter moves for batch/rate seconds. After a warm-up that shows the prefill rate, a
  batch longer than stall_after is never a stall; a real hang afterwards (the loop spinning,
  nothing moving) is killed once the batch bound has passed.
- A long prefill that starves decode (SGLang-style separate prefill batches): the decode gap
  is reported, the engine is never killed.
- SIGSTOP: the next poll says `unresponsive` with no rate; killed within stall_after + poll
  + grace + http_timeout (a stopped process gets no batch stretch).
- llama-server tokens/s counts tokens: busy slots x steps, not steps."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, run_watchdog_until
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


STALL_AFTER, POLL, GRACE, HTTP_TIMEOUT = 1.5, 0.25, 0.5, 0.4
SLACK = 2.0  # a loaded 2-core box


def _cfg(name, sim, **kw):
    base = dict(process={"cmdline": rf"--kind {sim.kind} --port {sim.port}( |$)"}, stall_after=STALL_AFTER,
                poll_interval=POLL, http_timeout=HTTP_TIMEOUT, action="kill", grace=GRACE)
    return engine_cfg(name, sim.kind, sim.url, **{**base, **kw})


def _post(sim, **body):
    # /completion is answered on the HTTP thread, never the main loop: it returns at once
    httpx.post(sim.url + "/sim/requests", json=body, timeout=5).raise_for_status()


def _rate_known(wd, name):
    s = wd.snapshots().get(name)
    return s is not None and (s.evidence.get("prefill_batch") or {}).get("prefill_rate_tokens_per_second")


def test_llama_long_prompt_batch_is_not_a_stall_but_a_hang_is_killed(sims):
    sim = sims("llamacpp", "--prefill-rate", "1000", "--batch-size", "3000", "--slots", "2")
    audit, events = [], []
    wd = EngineWatchdog([_cfg("llama", sim)], audit.append, events.append)
    states: list[str] = []

    def track():
        s = wd.snapshots().get("llama")
        if s is not None and (not states or states[-1] != s.state):
            states.append(s.state)
        return s

    async def scenario():
        await asyncio.to_thread(_post, sim, count=1)  # one request decoding
        assert await run_watchdog_until(wd, lambda: (s := track()) and s.state == "busy", 20), states
        await asyncio.to_thread(_post, sim, count=1, prompt_tokens=400, max_tokens=1)  # warm-up: 0.4 s
        assert await run_watchdog_until(wd, lambda: track() and _rate_known(wd, "llama"), 20), wd.snapshots()
        rate = _rate_known(wd, "llama")
        assert abs(rate - 1000) < 1, rate  # the engine's own prompt seconds
        # a 3000-token prompt: one 3 s batch, twice stall_after, nothing answers meanwhile
        await asyncio.to_thread(_post, sim, count=1, prompt_tokens=3000, max_tokens=1)
        silent = await run_watchdog_until(
            wd, lambda: (s := track()) and s.metrics_error == "timeout" and s.no_progress_seconds > STALL_AFTER and s, 20)
        assert silent, states
        assert silent.evidence["prefill_batch"]["applies"] and not silent.stalled, dict(silent.evidence)
        # the batch ends, progress resumes
        back = await run_watchdog_until(wd, lambda: (s := track()) and s.metrics_error is None
                                        and s.no_progress_seconds == 0 and s.heartbeat > silent.heartbeat and s, 20)
        assert back and back.state == "busy", states
        assert audit == [] and not [e for e in events if e.kind in ("engine_stalled", "engine_killed")], \
            [e.message for e in events]
        # a real hang: the main loop spins, nothing moves
        await asyncio.to_thread(sim.control, "stall")
        t0 = time.monotonic()
        done = await run_watchdog_until(wd, lambda: audit and not alive(sim.pid), 40)
        return done, time.monotonic() - t0

    done, elapsed = asyncio.run(scenario())
    assert done, (states, wd.snapshots())
    rec = audit[0]
    assert rec["what"] == "kill" and rec["why"] in ("heartbeat_flat", "metrics_unanswered", "cpu_spin")
    batch = rec["evidence"]["prefill_batch"]
    assert batch["applies"] and batch["bound_seconds"] == 6.0  # 2 x 3000 tokens / 1000 tokens/s
    assert "nothing from outside separates" in batch["note"]
    assert 6.0 - POLL <= elapsed <= 6.0 + POLL + GRACE + HTTP_TIMEOUT + SLACK, elapsed
    assert rec["result"]["gone"]


def test_sim_prefill_starving_decode_reports_the_gap_and_is_never_killed(sims):
    """INCIDENTS §9: a 16k-token prompt in 512-token batches, no decode tokens meanwhile."""
    sim = sims("sglang", "--prefill-rate", "4000", "--batch-size", "512", "--starve-decode")
    audit, events = [], []
    wd = EngineWatchdog([_cfg("sgl", sim)], audit.append, events.append)
    gaps: list[float] = []

    def track():
        s = wd.snapshots().get("sgl")
        if s is not None and s.decode_gap_seconds is not None:
            gaps.append(s.decode_gap_seconds)
        return s

    async def scenario():
        await asyncio.to_thread(_post, sim, count=1)
        assert await run_watchdog_until(wd, lambda: (s := track()) and s.state == "busy" and s.tokens_per_second, 20)
        await asyncio.to_thread(_post, sim, count=1, prompt_tokens=16000, max_tokens=5)
        starved = await run_watchdog_until(
            wd, lambda: (s := track()) and s.decode_gap_seconds > 2 * STALL_AFTER and s, 30)
        assert starved, gaps[-20:]
        assert not starved.stalled and starved.no_progress_seconds < STALL_AFTER
        # decoding again; the longest gap stays reported
        again = await run_watchdog_until(
            wd, lambda: (s := track()) and s.tokens_per_second and s.generated_tokens_total > starved.generated_tokens_total
            and s, 30)
        assert again, gaps[-20:]
        return again

    again = asyncio.run(scenario())
    assert again.decode_gap_seconds >= 2 * STALL_AFTER
    assert audit == [] and not [e for e in events if e.kind in ("engine_stalled", "engine_killed")], \
        [e.message for e in events]
    assert alive(sim.pid)


def test_sigstopped_engine_is_unresponsive_with_no_rate_then_killed(sims):
    sim = sims("llamacpp", "--prefill-rate", "1000", "--batch-size", "3000")
    audit, events = [], []
    wd = EngineWatchdog([_cfg("llama", sim)], audit.append, events.append)
    after: list = []

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("llama")) and s.state == "idle", 20)
        await asyncio.to_thread(_post, sim, count=1, prompt_tokens=300)
        assert await run_watchdog_until(
            wd, lambda: _rate_known(wd, "llama") and wd.snapshots()["llama"].tokens_per_second, 20), wd.snapshots()
        last = wd.snapshots()["llama"].polls
        os.kill(sim.pid, signal.SIGSTOP)
        t0 = time.monotonic()

        def watch():
            s = wd.snapshots()["llama"]
            if s.polls > last and (not after or after[-1].polls != s.polls):
                after.append(s)
            return audit and not alive(sim.pid)

        done = await run_watchdog_until(wd, watch, 30)
        return done, time.monotonic() - t0

    done, elapsed = asyncio.run(scenario())
    assert done, after
    first = next(s for s in after if s.health == "timeout")  # the first poll that waited out the stopped process
    assert first.state == "unresponsive" and first.tokens_per_second is None, first
    assert elapsed <= STALL_AFTER + POLL + GRACE + HTTP_TIMEOUT + SLACK, elapsed
    ev = audit[0]["evidence"]
    assert ev["gpu_process_state"] == "T" and not ev["prefill_batch"]["applies"]
    assert ev["prefill_batch"]["why_not"].startswith("process state T")


def test_llama_rate_counts_tokens_of_every_busy_slot(sims):
    sim = sims("llamacpp", "--slots", "4", "--step-time", "0.02")
    wd = EngineWatchdog([_cfg("llama", sim)], lambda r: None, lambda e: None)
    rates: list[float] = []

    def engine_count():
        st = sim.control("state")
        return st["generation_tokens"], st["steps"], time.monotonic()

    async def scenario():
        await asyncio.to_thread(_post, sim, count=4)
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("llama")) and s.tokens_per_second, 20)
        a = await asyncio.to_thread(engine_count)
        last = [0]

        def collect():
            s = wd.snapshots()["llama"]
            if s.polls != last[0] and s.tokens_per_second is not None:
                last[0] = s.polls
                rates.append(s.tokens_per_second)
            return None

        t_end = time.monotonic() + 4.0
        await run_watchdog_until(wd, lambda: collect() or time.monotonic() > t_end, 10)
        b = await asyncio.to_thread(engine_count)
        return a, b

    (tok_a, steps_a, ta), (tok_b, steps_b, tb) = asyncio.run(scenario())
    own = (tok_b - tok_a) / (tb - ta)  # the engine's own token count over the same seconds
    steps = (steps_b - steps_a) / (tb - ta)
    mean = sum(rates) / len(rates)
    assert len(rates) >= 5, rates
    assert abs(mean - own) <= 0.1 * own, (mean, own, rates)
    assert mean > 3 * steps  # four slots: four tokens a step, not one
